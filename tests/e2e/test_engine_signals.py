"""Issue 21, defect 4: a colocated SGLang engine in the trainer's process must not take over its
signals. sglang.Engine needs a GPU, so a TEST DOUBLE stands in for it that does to the process's
handlers what the real Engine does, read from SGLang's source (sglang_doubles.
SignalTakingEngineForTests): on its first call it registers asyncio handlers for the signals
TokenizerManager.auto_create_handle_loop registers (SIGTERM: a graceful engine exit; SIGQUIT:
kill the process tree). Everything else is the project's: StopSignals, SGLangEngine.colocated
(whose start-up release is the engine's first call) and stop_reason, which decides the
checkpoint-and-exit of Trainer.run.

Issue 63, defects 5 and 6: the engine's death (SIGQUIT from SGLang's watchdog) between engine calls
is recorded, not raised where the trainer happens to be (it failed a checkpoint save as "Worker
failure: ... EngineDied" and blamed the disk), and the next call raises EngineDied. During a call
the real Engine waits in its uvloop event loop (SGLang's policy), which runs Python signal handlers
as one of its callbacks and only logs what they raise: the call waited for ever on the dead
scheduler. A second double waits in a real uvloop loop as the Engine does (run_until_complete); the
death ends its call at once with EngineDied. A third registers SGLang's SIGTERM handler on a real
uvloop loop in its first call, as TokenizerManager does: uvloop keeps a handler removed while its
loop is not running, and a SIGTERM during a later call reached SGLang's drain as well as the
trainer (a real resumed run hung so: its engine shut down under the stop checkpoint)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.helpers.tiny_hf import save_tiny

REPO = Path(__file__).resolve().parents[2]

SCRIPT = """
import json, os, signal, sys, time
from pathlib import Path
from vapo_megatron.trainer.signals import StopSignals

stop = StopSignals().install()
from vapo_megatron.mcore import parallel
from vapo_megatron.rollout.sglang_engine import SGLangEngine, engine_kwargs
from vapo_megatron.trainer.deadline import Deadline, StepClock
from vapo_megatron.trainer.signals import stop_reason
from tests.helpers.sglang_doubles import SignalTakingEngineForTests
try:
    from vapo_megatron.rollout.engine_signals import EngineDied
except ImportError:  # a tree without it
    EngineDied = RuntimeError

parallel.init_distributed(1, 1)
hf = Path(sys.argv[1])
doubles = []
start = lambda cfg: doubles.append(SignalTakingEngineForTests(hf, cfg, engine_kwargs(cfg))) or doubles[-1]
engine = SGLangEngine.colocated(model_path=str(hf), tp_size=1, mem_fraction=0.5, dtype="float32", seed=0, start=start)
out = {"first_call": doubles[0].calls[0]}
os.kill(os.getpid(), signal.SIGTERM)  # Slurm's preemption notice
time.sleep(0.2)
out["signum"] = stop.signum
out["stop_reason"] = stop_reason(stop, Deadline.from_setting("none", 0.0), StepClock(), final=False)
print(json.dumps(out), flush=True)
try:
    os.kill(os.getpid(), signal.SIGQUIT)  # what SGLang's SubprocessWatchdog sends when a scheduler dies
    time.sleep(1)  # between engine calls, e.g. writing a checkpoint: nothing is raised here
    out["sigquit"] = "recorded"
except EngineDied as e:
    out["sigquit"] = "raised: " + str(e)
try:
    engine.resume_memory(("kv_cache",))
    out["next_call"] = "ran"
except EngineDied as e:
    out["next_call"] = str(e)
print(json.dumps(out), flush=True)

import asyncio, threading, uvloop
from vapo_megatron.rollout.engine_signals import EngineDeath

class TakingEngine:  # TEST DOUBLE: SGLang's takeover of SIGTERM in its first call, on a real uvloop loop
    loop = uvloop.new_event_loop()
    drained = []  # SGLang's SIGTERM handler: drain the requests, then shut the engine down

    def begin_weight_update(self):
        async def first_call():  # TokenizerManager.auto_create_handle_loop, inside the Engine's loop
            self.loop.add_signal_handler(signal.SIGTERM, lambda: self.drained.append("SIGTERM"))
        return self.loop.run_until_complete(first_call())

    def flush_cache(self):
        async def later_call():
            os.kill(os.getpid(), signal.SIGTERM)  # Slurm's SIGTERM while the trainer waits on the engine
            await asyncio.sleep(0.5)
        return self.loop.run_until_complete(later_call())

taking = SGLangEngine(TakingEngine(), death=EngineDeath("the taking engine"))
stop.signum = 0
taking._call("begin_weight_update")
taking._call("flush_cache")
out["sigterm_in_a_later_call"] = {"trainer": stop.signum, "sglang": TakingEngine.drained}

class WaitingEngine:  # TEST DOUBLE: a call that waits in the engine's loop for a scheduler's answer
    loop = uvloop.new_event_loop()

    def flush_cache(self):
        return self.loop.run_until_complete(asyncio.sleep(30))

death = EngineDeath("the waiting engine").install()
waiting = SGLangEngine(WaitingEngine(), death=death)
threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGQUIT)).start()  # the scheduler dies meanwhile
t0 = time.monotonic()
try:
    waiting._call("flush_cache")
    out["waiting_call"] = "returned"
except EngineDied as e:
    out["waiting_call"] = str(e)
out["waited_s"] = time.monotonic() - t0
print(json.dumps(out), flush=True)
"""


def test_sigterm_still_stops_the_trainer_and_a_dead_engine_is_a_named_error(tmp_path):
    save_tiny(tmp_path / "hf", tied=False, seed=5)
    script = tmp_path / "owner.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    run = subprocess.run([sys.executable, str(script), str(tmp_path / "hf")], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    lines = [json.loads(x) for x in run.stdout.splitlines() if x.startswith("{")]
    assert lines, f"the engine owner died (exit {run.returncode}):\n{run.stderr[-3000:]}"
    first = lines[0]
    assert first["first_call"] == ["release", ["weights", "kv_cache", "cuda_graph"]]  # the double took the signals
    assert first["signum"] == 15 and first["stop_reason"] == "SIGTERM", first  # -> checkpoint, exit for requeue
    assert len(lines) == 3, f"SIGQUIT killed the owner without a word (exit {run.returncode}):\n{run.stderr[-3000:]}"
    done = lines[1]
    assert done["sigquit"] == "recorded", done  # not raised into whatever the trainer was doing
    # the next call fails, naming the engine
    assert done["next_call"].startswith("SGLang engine of trainer ranks [0] (GPUs 0..0 of host"), done
    assert "died" in done["next_call"], done
    waited = lines[2]
    # uvloop kept SGLang's SIGTERM handler past the call that registered it, and ran it as well
    assert waited["sigterm_in_a_later_call"] == {"trainer": 15, "sglang": []}, waited
    assert waited["waiting_call"].startswith("the waiting engine died"), waited  # not a call that waits on
    assert waited["waited_s"] < 10, waited
