"""vapo_megatron/rollout/sglang_engine.py's shutdown and memory tags against the installed SGLang's own
source (tests/helpers/sglang_source.py): the shutdown ends the engine's processes only (issue 63)."""

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
    assert ast.unparse(method_node(engine_cls, "get_all_child_pids")).endswith("return self._scheduler_init_result.all_child_pids")
    launch = ast.unparse(method_node(engine_cls, "_launch_subprocesses"))
    assert "for p in detoken_procs:\n        scheduler_init_result.all_child_pids.append(p.pid)" in launch
