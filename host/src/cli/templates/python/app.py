"""`{{name}}`: a scheduling policy for the `host` engine, in Python.

Once per engine step the host hands the policy its waiting queue as
parallel lists (position `i` of every list is the same request) and asks in
which order to try to admit them; when KV-cache blocks run out it asks which
running request to preempt. This one serves the newest request first (last
come, first served) and preempts the request that has computed the fewest
tokens.

Built with componentize-py against the `scheduling-policy-plugin` world of
`wit/` (`host plugin build`). The sandbox grants no WASI capability (the
component is built with `--stub-wasi`), so `print` goes nowhere: log through
the host's `logging` import instead, as `init` does.
"""

import json
from typing import List, Optional

from componentize_py_types import Err
from wit_world import exports
from wit_world.exports.scheduling_policy import RunningBatch, WaitingQueue
from wit_world.imports import logging as host_log
from wit_world.imports.types import PluginKind, PluginMetadata

NAME = "{{name}}"
VERSION = "0.1.0"


def newest_first(n: int) -> List[int]:
    """Positions in admission order: the newest arrival first."""
    return list(range(n - 1, -1, -1))


def least_computed(num_computed_tokens: List[int]) -> Optional[int]:
    """The position of the running request with the fewest computed tokens."""
    if not num_computed_tokens:
        return None
    return min(range(len(num_computed_tokens)), key=lambda i: num_computed_tokens[i])


class SchedulingPolicy(exports.SchedulingPolicy):
    """The exported interface; componentize-py instantiates it once."""

    def metadata(self) -> PluginMetadata:
        return PluginMetadata(name=NAME, version=VERSION, kind=PluginKind.SCHEDULING_POLICY, options=[])

    def init(self, options: str) -> None:
        """Called once with the options JSON object (`{}` when none); raising
        `Err(message)` refuses the configuration."""
        try:
            parsed = json.loads(options)
        except ValueError as e:
            raise Err(f"options are not JSON ({e})")
        if parsed:
            raise Err(f"{NAME} takes no options, got {options}")
        host_log.log(host_log.Level.INFO, "started: newest request first")

    def order_waiting(self, queue: WaitingQueue) -> List[int]:
        return newest_first(len(queue.ids))

    def pick_victim(self, running: RunningBatch) -> Optional[int]:
        return least_computed(running.num_computed_tokens)
