"""Model pairing: loading a model with the backend that fits it, pairing a target with a draft, and
`--draft auto`'s choice."""
