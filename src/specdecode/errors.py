"""The library's error for a bad option value, which every entry point shows in its own words.

An OptionError names the option as the library spells it (a keyword of load_model, a field of ModelOptions or
ServerSettings, an arg of a Ray Serve config); its message starts with that name. The CLI swaps the name for its
flag ("max_batch_size must be ..." -> "--max-batch-size must be ..."); the server's config shows it as it is.
"""

from __future__ import annotations


class OptionError(ValueError):
    def __init__(self, option: str, message: str):
        super().__init__(message)
        self.option = option
