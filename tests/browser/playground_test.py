"""Drives the web page of a running `host serve` in headless Chromium.

Usage: playground_test.py BASE_URL SCREENSHOT.png [--api-key KEY]
                          [--prompt TEXT --max-tokens N]

Loads BASE_URL/ in Debian's chromium through its chromedriver (selenium,
nothing downloaded). With --api-key, first checks that the page asks for the
key (and does not show the model before it has it), then types it. With
--prompt, sets temperature 0 and max_tokens N, sends the prompt and waits for
the streamed answer. Saves a screenshot and prints one JSON object for the
Rust test to check: {"asked_for_key", "model", "context", "plugins",
"answer", "stats", "ttft_ms", "tokens_per_s", "gauges"}.
"""

import argparse
import json
import os
import shutil
import sys

# Selenium must use the system's chromedriver, never fetch one.
os.environ["SE_OFFLINE"] = "true"

from selenium import webdriver  # noqa: E402
from selenium.common.exceptions import TimeoutException  # noqa: E402
from selenium.webdriver.chrome.options import Options  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

INSTALL = "install them with `apt-get install chromium chromium-driver`"


def browser():
    chromium = shutil.which("chromium")
    driver = shutil.which("chromedriver")
    if not chromium or not driver:
        sys.exit(f"chromium or chromedriver is not on PATH; {INSTALL}")
    options = Options()
    options.binary_location = chromium
    for arg in ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1280,900", "--no-first-run", "--disable-extensions"]:
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(executable_path=driver), options=options)


def text_of(d, css):
    return d.execute_script(
        "const e = document.querySelector(arguments[0]); return e ? e.textContent : null;", css
    )


def wait(d, what, predicate, seconds=120):
    try:
        return WebDriverWait(d, seconds, poll_frequency=0.05).until(lambda d: predicate(d))
    except TimeoutException:
        logs = "\n".join(str(entry) for entry in d.get_log("browser"))
        sys.exit(f"timed out waiting for {what}\nbrowser console:\n{logs}")


def set_value(d, element_id, value):
    e = d.find_element(By.ID, element_id)
    e.clear()
    e.send_keys(value)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("base_url")
    ap.add_argument("screenshot")
    ap.add_argument("--api-key")
    ap.add_argument("--prompt")
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args()
    result = {"asked_for_key": False}
    d = browser()
    try:
        d.get(args.base_url + "/")
        if args.api_key:
            form = d.find_element(By.ID, "key-form")
            wait(d, "the API key form", lambda d: form.is_displayed())
            result["asked_for_key"] = True
            if text_of(d, "#model") != "…":
                sys.exit("the page showed the model without the key")
            d.find_element(By.ID, "api-key").send_keys(args.api_key)
            d.find_element(By.ID, "key-save").click()
            wait(d, "the key form to close", lambda d: not form.is_displayed())
        wait(d, "the model's name", lambda d: text_of(d, "#model") not in (None, "…"))
        wait(d, "the plugin list", lambda d: d.find_elements(By.CSS_SELECTOR, "#plugins li.plugin"))
        result["model"] = text_of(d, "#model")
        result["context"] = text_of(d, "#context")
        result["plugins"] = [e.get_attribute("textContent") for e in d.find_elements(By.CSS_SELECTOR, "#plugins li")]
        # The gauges poll /metrics every second: wait for two samples.
        wait(d, "the gauges", lambda d: text_of(d, "#g-kv").endswith("%"))
        result["gauges"] = {k: text_of(d, f"#g-{k}") for k in ("running", "waiting", "kv")}
        if args.prompt:
            set_value(d, "temperature", "0")
            set_value(d, "max_tokens", str(args.max_tokens))
            d.find_element(By.ID, "prompt").send_keys(args.prompt)
            d.find_element(By.ID, "send").click()
            done = ".message.assistant[data-done='true']"
            wait(d, "the streamed answer", lambda d: d.find_elements(By.CSS_SELECTOR, done))
            result["answer"] = text_of(d, done + " .answer")
            result["stats"] = text_of(d, done + " .stats")
            stats = d.find_element(By.CSS_SELECTOR, done + " .stats")
            result["ttft_ms"] = float(stats.get_attribute("data-ttft-ms") or "nan")
            result["tokens_per_s"] = float(stats.get_attribute("data-tokens-per-s") or "nan")
        d.save_screenshot(args.screenshot)
        # The 401 before the key was typed is the page asking for it.
        severe = [e for e in d.get_log("browser")
                  if e.get("level") == "SEVERE" and "401" not in e.get("message", "")]
        if severe:
            sys.exit(f"the page logged errors: {severe}")
    finally:
        d.quit()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
