"""What the client scripts share: a check that prints one line and counts,
safe across the threads that run requests at once, and the summary line
`Server::run_openai_script` looks for; and the functions the tool-calling
scripts offer (name, description, parameters: each API wraps them in its
own tool shape)."""

import sys
import threading


class Checks:
    """Call it with (name, ok, detail) per check; `finish()` exits."""

    def __init__(self):
        self.passed = 0
        self.failed = []
        self._lock = threading.Lock()

    def __call__(self, name, ok, detail=""):
        with self._lock:
            if ok:
                self.passed += 1
                print(f"ok {name}", flush=True)
            else:
                self.failed.append(name)
                print(f"FAIL {name}: {detail}", flush=True)

    def finish(self):
        print(f"{self.passed} passed, {len(self.failed)} failed")
        sys.exit(1 if self.failed else 0)


WEATHER = {
    "name": "get_weather",
    "description": "The current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 40},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
    },
}
ADD = {
    "name": "add",
    "description": "Adds two integers",
    "parameters": {
        "type": "object",
        "properties": {
            "a": {"type": "integer", "minimum": -1000, "maximum": 1000},
            "b": {"type": "integer", "minimum": -1000, "maximum": 1000},
        },
        "required": ["a", "b"],
    },
}
