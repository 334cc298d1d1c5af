"""Programs run and host fetches of one trainer step after its rewards, read from an XLA trace.

`count_after_rewards(trainer, step, folder)` runs `trainer.step(step)` under `jax.profiler.trace`
and counts, between the end of the step's `reward` phase and the end of the step (the `weight_sync`
phase and the wait for an overlapped rollout left out):

- programs: XLA executions (`CommonPjRtLoadedExecutable::ExecuteHelperOnSingleDevice`, one device),
  eager operations included (each is a small program of its own), on the step's own thread (an overlapped rollout's are another's);
- waits (host round trips): the calls where the host waits for the device, read from the Python
  tracer's events: `jax.device_get`, `distributed.to_host`, `jax.block_until_ready` (the outermost
  call counted once: `device_get` of a pytree copies every leaf but waits once), and any other
  device-to-host copy (`np.asarray` or `float` of an array) outside them.

One device only (several devices execute a program once each). Works on this checkout and on an
older one alike: it reads nothing of the trainer but its phase names.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import jax

EXECUTE = "CommonPjRtLoadedExecutable::ExecuteHelperOnSingleDevice"
FETCH = "np.asarray(jax.Array)"
WAITS = (" device_get", " to_host", " block_until_ready")  # Python tracer: "$<file>:<line> <name>"
LEFT_OUT = ("weight_sync",)  # the push to the sampler: not the update's


def _events(folder: Path) -> list[dict]:
    events = []
    for file in sorted(folder.rglob("*.trace.json.gz")):
        data = json.loads(gzip.decompress(file.read_bytes()))
        events += [e for e in data["traceEvents"] if e.get("ph") == "X" and "ts" in e]
    return sorted(events, key=lambda e: e["ts"])


def count_after_rewards(trainer, step: int, folder: str | Path) -> dict:
    """{"programs": n, "waits": n, "metrics": the step's metrics} (see the module docstring)."""
    folder = Path(folder)
    with jax.profiler.trace(str(folder)), jax.profiler.TraceAnnotation("counted_step"):
        metrics = trainer.step(step)
    events = _events(folder)
    whole = next(e for e in events if e["name"] == "counted_step")
    reward = next(e for e in events if e["name"] == "reward" and e["ts"] >= whole["ts"])
    begin, end = reward["ts"] + reward["dur"], whole["ts"] + whole["dur"]
    out_spans = [(e["ts"], e["ts"] + e["dur"]) for e in events if e["name"] in LEFT_OUT]
    mine = [
        e
        for e in events
        if e["tid"] == whole["tid"]  # the step's own thread (not an overlapped rollout's)
        and begin <= e["ts"] <= end
        and not any(a <= e["ts"] <= b for a, b in out_spans)
    ]
    calls = [e for e in mine if e["name"].startswith("$") and e["name"].endswith(WAITS)]
    outer = [c for c in calls if not any(_inside(c, o) for o in calls if o is not c)]
    copies = [e for e in mine if e["name"] == FETCH and not any(_inside(e, o) for o in outer)]
    programs = sum(e["name"] == EXECUTE for e in mine)
    return {"programs": programs, "waits": len(outer) + len(copies), "metrics": metrics}


def _inside(e: dict, o: dict) -> bool:
    return o["ts"] <= e["ts"] and e["ts"] + e["dur"] <= o["ts"] + o["dur"]
