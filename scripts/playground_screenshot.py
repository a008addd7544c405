"""A PNG screenshot of the playground page after a greedy generation (for the README). Starts no server: give the
URL of a running `specdecode serve`.

    specdecode serve &                     # the default pair
    python scripts/playground_screenshot.py http://127.0.0.1:8000 --prompt "def quicksort(arr):" \
        --max-tokens 128 --out docs/playground.png

Needs Chromium and chromedriver (Debian: apt install chromium chromium-driver) and selenium (pip install selenium).
With --race, the screenshot shows a race (plain, then speculative) instead of a single generation.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time


def browser(width: int, height: int):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    chromium, driver = shutil.which("chromium") or shutil.which("chromium-browser"), shutil.which("chromedriver")
    if not (chromium and driver):
        sys.exit("needs Chromium and chromedriver on PATH: apt install chromium chromium-driver")
    profile = tempfile.mkdtemp(prefix="specdecode-screenshot-")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 f"--user-data-dir={profile}", f"--window-size={width},{height}", "--hide-scrollbars"):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(driver), options=options), profile


def text_of(driver, element_id: str) -> str:
    return driver.execute_script("return document.getElementById(arguments[0]).textContent", element_id)


def set_field(driver, element_id: str, value: str) -> None:
    element = driver.find_element("id", element_id)
    element.clear()
    element.send_keys(value)


def wait(driver, predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            sys.exit(f"timed out after {timeout:g} s waiting for {what}; the page's error box says: "
                     f"{text_of(driver, 'error') or '(nothing)'}")
        time.sleep(0.1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("url", help="the running server, e.g. http://127.0.0.1:8000")
    parser.add_argument("--prompt", default="def quicksort(arr):")
    parser.add_argument("--chat", action="store_true", help="send the prompt as a chat message")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("-k", default="default", help='K: "default" (the server\'s), "auto" or an integer')
    parser.add_argument("--race", action="store_true", help="run the race (plain, then speculative)")
    parser.add_argument("--api-key", default="")
    parser.add_argument("--out", default="playground.png")
    parser.add_argument("--width", type=int, default=1280)
    parser.add_argument("--height", type=int, default=900)
    parser.add_argument("--timeout", type=float, default=600, help="seconds to wait for the generation")
    args = parser.parse_args()

    driver, profile = browser(args.width, args.height)
    try:
        driver.get(args.url.rstrip("/") + "/")
        wait(driver, lambda: text_of(driver, "target-name") not in ("", "…") or text_of(driver, "error"), 60,
             "the server's model names")
        if text_of(driver, "error"):
            sys.exit(f"the page shows an error: {text_of(driver, 'error')}")
        if args.api_key:
            set_field(driver, "api-key", args.api_key)
        set_field(driver, "prompt", args.prompt)
        set_field(driver, "temperature", "0")
        set_field(driver, "max-tokens", str(args.max_tokens))
        if args.chat:
            driver.find_element("css selector", 'input[name="mode"][value="chat"]').click()
        driver.find_element("css selector", f'#k option[value="{args.k}"]').click()
        driver.find_element("id", "race" if args.race else "generate").click()
        wait(driver, lambda: driver.execute_script("return document.body.dataset.state") == "idle", args.timeout,
             "the generation to end")
        if text_of(driver, "status") != "done":
            sys.exit(f"the generation ended with {text_of(driver, 'status')!r}: {text_of(driver, 'error')}")
        time.sleep(0.3)  # the last animation frame (counters, chart)
        # the whole page, however tall: resize the window to the document before the shot
        height = driver.execute_script("return document.documentElement.scrollHeight")
        driver.set_window_size(args.width, max(args.height, height))
        driver.save_screenshot(args.out)
        print(f"saved {args.out}: {text_of(driver, 'c-tokens')} tokens, {text_of(driver, 'c-tps')} tokens/s, "
              f"acceptance {text_of(driver, 'c-acceptance')}, mean accepted length {text_of(driver, 'c-mal')}")
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


if __name__ == "__main__":
    main()
