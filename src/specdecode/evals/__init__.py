"""Evaluations of the output distribution: `multiplication` (task accuracy, plain vs speculative sampling) and
`verify` (an exact losslessness check of a target/draft pair). Import the submodules directly."""
