"""A built-in model's first check started before the caller's imports: joining its GGUF's parts and computing the
sha256 (5 s of one core for the 1.5B on a 2-core CPU without SHA instructions) on the core that importing torch and
the backends leaves idle (~5 s of the other), instead of beside llama.cpp's load and the tokenizer's extraction,
which already keep both cores busy. preparing_gguf finds it in prepare.CHECKS_AHEAD, waits for the file to be
whole, and loads it while the checksum ends (loading_beside): nothing unchecked is used, the check is only earlier.
Any failure here (sizes, a wrong file, an interrupted run) leaves the file unstamped, and preparing_gguf checks it
again and says what is wrong."""

from __future__ import annotations

import atexit
import contextlib
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Iterator

from . import catalog, prepare


def check_ahead(name: str) -> bool:
    """Join and check built-in model `name`'s GGUF in a background thread from now on; whether one started (not for
    a name the catalog does not know, a file checked before, parts not installed, or one already started)."""
    if not catalog.is_registered(name):
        return False
    info = catalog.lookup(name)
    if info.name in prepare.CHECKS_AHEAD or catalog.missing_modules(info) or prepare._checked_location(info):
        return False
    check = Check(info)
    prepare.CHECKS_AHEAD[info.name] = check
    # a run that ends early (a bad argument, an interrupt) stops the checksum and waits for the copy (a second),
    # which deletes its partial file: never a gigabyte left in the cache
    atexit.register(check.stop_and_wait)
    check.start()
    return True


class Check(threading.Thread):
    """The background thread: under the model's lock, its size checked, its parts joined, its sha256 computed and,
    where it is right and the check was not stopped, the file's stamp written."""

    def __init__(self, info: catalog.ModelInfo):
        super().__init__(name="specdecode-check-ahead", daemon=True)
        self.info, self.stop = info, threading.Event()
        self.joined = threading.Event()  # set once the file is in place (or the check has ended without it)
        self.in_place = False  # the file is whole and its checksum under way or done
        self.digest: str | None = None

    def run(self) -> None:
        info = self.info
        try:
            with contextlib.suppress(Exception), prepare._conversion_lock(info.name):
                if prepare._checked_location(info) is not None:
                    return  # another process checked it while this one waited
                path = prepare._gguf_location(info)
                prepare._check_size(info, path)
                if len(info.parts) > 1:
                    prepare._copy_parts(info, path, None)
                self.in_place = True
                self.joined.set()
                digest = prepare._sha256(path, "", None, self.stop)
                if not self.stop.is_set():
                    self.digest = digest
                    if digest == info.sha256:
                        prepare._write_stamp(info, path)
        finally:
            self.joined.set()

    def stop_and_wait(self) -> None:
        self.stop.set()
        if self.is_alive():
            self.join()

    def loading(self) -> contextlib.AbstractContextManager[prepare.PreparedGguf]:
        return loading_beside(self)


@contextlib.contextmanager
def loading_beside(check: Check) -> Iterator[prepare.PreparedGguf]:
    """preparing_gguf beside a check begun ahead whose file is in place: the body loads it and the tokenizer is built
    while the checksum ends, and leaving waits for both. As preparing_gguf's own check: a wrong file raises
    ModelIntegrityError on the way out, with the joined copy and the tokenizer built from it deleted."""
    info = check.info
    path = prepare._gguf_location(info)
    built = not prepare.tokenizer_prepared(info)
    with ThreadPoolExecutor(1, thread_name_prefix="specdecode-tokenizer") as pool:
        tokenizer = pool.submit(prepare._tokenizer_locked, info, path)  # the check holds the lock meanwhile
        try:
            yield prepare.PreparedGguf(path, tokenizer)
        except BaseException as failure:
            if not isinstance(failure, Exception):
                check.stop.set()
            wait([tokenizer])
            check.join()
            if not prepare._stamp_matches(info, path):
                _forget_tokenizer(info, built)
                if check.digest is not None:
                    raise prepare._mismatch(info, path, check.digest) from failure
            raise
        wait([tokenizer])
    check.join()
    if not prepare._stamp_matches(info, path):
        _forget_tokenizer(info, built)
        raise prepare._mismatch(info, path, check.digest or "no checksum (the check ended early)")


def _forget_tokenizer(info: catalog.ModelInfo, built: bool) -> None:
    if built:
        shutil.rmtree(catalog.tokenizer_path(info.name), ignore_errors=True)
