"""Benchmarks: our loop against its peers (runner, with one class per method in methods/ and the report in
report), the step costs and latency (costs, latency), the one interleave loop they share (interleave), the
statistics they rest on (stats), the built-in prompt sets (prompts: code, prose, edit, and json with a schema per
prompt), the validity of JSON outputs (validity) and the figures (plot, serve). Import the submodules directly;
this package imports nothing heavy."""
