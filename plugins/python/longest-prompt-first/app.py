"""`py:longest-prompt-first`, a scheduling policy written in Python.

Admits the waiting request with the longest prompt first (ties in arrival
order): in an offline batch the long prompts then start early instead of
straggling at the end, which shortens the whole batch's makespan (longest
processing time first). It is the mirror image of the Rust plugin
`engine:shortest-prompt-first`, so a test can tell the two apart.

Preempts the running request that has computed the fewest tokens (the
latest admitted among equals), so the least work is thrown away.

Option `max_wait_s` (default 0 = off) bounds starvation: a request that has
waited longer than that, relative to the newest arrival, goes first.

Built with componentize-py against the `scheduling-policy-plugin` world of
`wit/`; see README.md. The sandbox grants no WASI capability, so this module
must not touch files, clocks, randomness or the environment at call time.
"""

import json
from typing import List, Optional

from componentize_py_types import Err
from wit_world import exports
from wit_world.exports.scheduling_policy import RunningBatch, WaitingQueue
from wit_world.imports.types import PluginKind, PluginMetadata, PluginOption

NAME = "py:longest-prompt-first"
VERSION = "0.1.0"


def parse_max_wait(options: str) -> float:
    """Reads `max_wait_s` (a number >= 0) from the options JSON object.

    Raises `ValueError` naming what was wrong and what is accepted.
    """
    try:
        parsed = json.loads(options)
    except ValueError as e:
        raise ValueError(f"options are not JSON ({e}): {options!r}") from None
    if not isinstance(parsed, dict):
        raise ValueError(f"options must be a JSON object, got {options!r}")
    unknown = sorted(set(parsed) - {"max_wait_s"})
    if unknown:
        raise ValueError(f"unknown option(s) {unknown}; the only option is max_wait_s")
    value = parsed.get("max_wait_s", 0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f"max_wait_s must be a number of seconds >= 0, got {value!r}")
    return float(value)


def longest_first(prompt_lens: List[int], arrival_times: List[float], max_wait_s: float) -> List[int]:
    """Positions in admission order: starved requests first, then by
    descending prompt length; `sorted` is stable, so ties keep arrival order."""
    newest = max(arrival_times, default=0.0)

    def key(i: int):
        starved = max_wait_s > 0 and newest - arrival_times[i] > max_wait_s
        return (not starved, -prompt_lens[i])

    return sorted(range(len(prompt_lens)), key=key)


def fewest_computed(num_computed_tokens: List[int]) -> Optional[int]:
    """The latest admitted position among those with the least computed work."""
    if not num_computed_tokens:
        return None
    least = min(num_computed_tokens)
    return max(i for i, n in enumerate(num_computed_tokens) if n == least)


class SchedulingPolicy(exports.SchedulingPolicy):
    """The exported interface; componentize-py instantiates it once."""

    def __init__(self) -> None:
        self.max_wait_s = 0.0

    def metadata(self) -> PluginMetadata:
        return PluginMetadata(
            name=NAME,
            version=VERSION,
            kind=PluginKind.SCHEDULING_POLICY,
            options=[
                PluginOption(
                    name="max_wait_s",
                    description="seconds a request may wait (relative to the newest arrival) "
                    "before it is admitted first; 0 disables",
                    default_json="0",
                )
            ],
        )

    def init(self, options: str) -> None:
        try:
            self.max_wait_s = parse_max_wait(options)
        except ValueError as e:
            raise Err(str(e))

    def order_waiting(self, queue: WaitingQueue) -> List[int]:
        return longest_first(queue.prompt_lens, queue.arrival_times, self.max_wait_s)

    def pick_victim(self, running: RunningBatch) -> Optional[int]:
        return fewest_computed(running.num_computed_tokens)
