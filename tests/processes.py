"""How the multi-process tests start their ranks: forked from a server that imported lit_dllm and the shared test
helpers once, instead of each rank importing them again (~9 s of CPU a rank); unlike a plain fork, a rank inherits no
state of earlier tests (a plain fork reused an earlier test's distributed-checkpoint save plan)."""

import multiprocessing

START_METHOD = "forkserver"
multiprocessing.set_forkserver_preload(["lit_dllm", "tests.test_parallel"])
