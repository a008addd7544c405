"""Text and tokens: the vocabulary target and draft share (and the check that they do), incremental
detokenization, chat templates."""
