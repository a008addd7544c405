"""Structured outputs and tools: grammars and constraints (llguidance), each row's grammar along a step,
tool-call dialects, their parsers and the distinct-calls matcher."""
