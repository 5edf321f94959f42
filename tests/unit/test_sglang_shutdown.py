"""SGLang's processes and the trainer's (issue 63): the engine's shutdown, against the installed SGLang's own
source (tests/helpers/sglang_source.py), ends the engine's processes only; torch's shm manager, which the CPU
weight payloads start, is born with the trainer's stop signals blocked; the memory tags are SGLang's."""

from __future__ import annotations


def test_memory_tags_are_sglangs():
    from sglang.srt.constants import GPU_MEMORY_ALL_TYPES

    from vapo_megatron.rollout.base import MEMORY_TAGS

    assert set(MEMORY_TAGS) == set(GPU_MEMORY_ALL_TYPES)


def test_the_engines_shutdown_ends_its_own_processes_only():
    """sglang.Engine.shutdown ends the engine with kill_process_tree(os.getpid(), include_parent=False):
    every descendant of the trainer, its reward workers and multiprocessing's resource tracker too
    (issue 63, defect 11: every SGLang run then ended with the tracker's KeyError traceback). SGLang's
    own shutdown, run from its source on a stand-in holding what it reads, through the trainer's
    SGLangEngine.shutdown: only the engine's processes (Engine.get_all_child_pids) are ended, each
    with its descendants. Read from the same source: the Engine registers that shutdown at exit
    (start_engine swaps it for stop_engine), and its child pids include the detokenizer's."""
    import ast
    import os
    from types import SimpleNamespace

    from tests.helpers.sglang_source import ENGINE_PY, class_node, method_node, sglang_function
    from vapo_megatron.rollout.sglang_engine import SGLangEngine

    killed = []

    def kill_process_tree(parent_pid, include_parent=True, skip_pid=None, wait_timeout=60):  # SGLang's signature
        killed.append((parent_pid, include_parent))

    class TokenizerManager:  # shutdown's isinstance checks: not one
        pass

    class EngineStandIn:  # TEST DOUBLE: the attributes sglang.Engine.shutdown reads, a started engine's
        _attached, tokenizer_manager, send_to_rpc, _multi_tokenizer_shm = False, None, None, None
        _weight_cache_daemon_procs: list = []
        _scheduler_init_result = SimpleNamespace(stop_grpc_server=lambda: None)
        shutdown = sglang_function(ENGINE_PY, "shutdown", cls="Engine", os=os, TokenizerManager=TokenizerManager,
                                   kill_process_tree=kill_process_tree)

        def get_all_child_pids(self):
            return [4101, 4102]  # a scheduler and the detokenizer

    SGLangEngine(EngineStandIn()).shutdown()
    assert killed == [(4101, True), (4102, True)], killed  # before: [(os.getpid(), False)], the whole tree

    engine_cls = class_node(ENGINE_PY, "Engine")
    init = ast.unparse(method_node(engine_cls, "__init__"))
    assert "atexit.register(self.shutdown)" in init
    assert ast.unparse(method_node(engine_cls, "get_all_child_pids")).endswith(
        "return self._scheduler_init_result.all_child_pids")
    launch = ast.unparse(method_node(engine_cls, "_launch_subprocesses"))
    assert "for p in detoken_procs:\n        scheduler_init_result.all_child_pids.append(p.pid)" in launch


SHM_MANAGER_SCRIPT = """
import json, os, signal
from pathlib import Path
import torch
from vapo_megatron.rollout.sglang_payloads import serialize_flattened_bucket, to_flattened_bucket

signal.signal(signal.SIGINT, lambda *_: None)  # the trainer's handlers (trainer/signals.py): not inherited by a helper
signal.signal(signal.SIGTERM, lambda *_: None)
serialize_flattened_bucket(to_flattened_bucket([("w", torch.ones(4))]))  # the first CPU payload starts the manager
for stat in Path("/proc").glob("[0-9]*/stat"):
    try:
        name, rest = stat.read_text().split(" (", 1)[1].rsplit(") ", 1)
    except (OSError, ValueError):
        continue
    fields = rest.split()
    if name == "torch_shm_manag" and int(fields[1]) == os.getpid():
        status = dict(l.split(":", 1) for l in (stat.parent / "status").read_text().splitlines() if ":" in l)
        print(json.dumps({"blocked": int(status["SigBlk"], 16), "session": int(fields[3]), "mine": os.getsid(0)}))
"""


def test_torchs_shm_manager_is_born_with_the_trainers_stop_signals_blocked(tmp_path):
    """Issue 63, defects 5, 6: SGLang's CPU engine gets its weights as CPU tensors shared through torch's
    file_system strategy (serialize_flattened_bucket), whose first use forks torch's torch_shm_manager
    from the trainer, in its process group, until the manager's setsid() a moment later (read here: it
    ends in a session of its own). A Ctrl-C to the group or Slurm's SIGTERM in that moment killed it,
    and the weight sync failed ("no response from torch_shm_manager") or waited for ever; a run resumed
    and signalled as its first sync began did both (tests/e2e/test_sglang_train_resume.py). Now it is
    born with SIGINT and SIGTERM blocked, as the engine's own processes are."""
    import json
    import os
    import signal
    import subprocess
    import sys

    from tests.helpers.train_runs import ROOT

    script = tmp_path / "share.py"
    script.write_text(SHM_MANAGER_SCRIPT)
    run = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0 and run.stdout.strip(), run.stderr[-3000:]
    manager = json.loads(run.stdout.strip().splitlines()[-1])
    assert manager["session"] != manager["mine"], manager  # it leaves the trainer's session: the window is its start
    for signum in (signal.SIGINT, signal.SIGTERM):
        assert manager["blocked"] & (1 << (signum - 1)), f"{signal.Signals(signum).name} not blocked: {manager}"
