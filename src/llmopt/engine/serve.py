"""vLLM's OpenAI server as llmopt starts it on this machine: vLLM's own server, with a
compatibility fix so that a precompiled start loads the model vLLM compiled and saved before,
vLLM's packed-weight linear kernels where llmopt chose them, on CPU its engine core forked
rather than spawned, Inductor's compiled C++ kernels shared between compile-cache entries
(`_shared_inductor_kernels`), on CPU the graph compiled piecewise where llmopt chose it
(`piecewise`), and vLLM's rendezvous file kept with its sockets, in the folder that goes
with the server (`_rendezvous_in_socket_folder`).

vLLM saves a compiled model whole (Dynamo's trace and Inductor's code, `VLLM_USE_AOT_COMPILE`).
On CPU, vLLM 0.32 compiles with the stock "inductor" backend, whose saved function is torch's
`BundledAOTAutogradSerializableCallable`; loading one calls `finalize_loading`, which only vLLM's
own backend's functions have, so every load fails and the model is traced and compiled again.
Torch's function has loaded everything when it is unpickled: it needs no finalizing, and the fix
gives it a `finalize_loading` that does nothing. A precompiled start of SmolLM2-135M then skips
Dynamo's trace (about 8 s on two cores) and the warm-up takes 4 s instead of 12.

vLLM gives a linear layer its packed-weight kernels (`weight_packed_linear` for bf16,
`int8_scaled_mm_with_quant` for int8) only on AMX processors, and bf16 ones only under 1 MiB; the
rest get oneDNN. The packed kernels also run on AVX-512 BF16/VNNI without AMX, and there they
decode faster: oneDNN's matrix-vector products stream cold weights at 10-25 GB/s, theirs at 21-33
(`platform.default_linear_kernels`). With `LLMOPT_PACKED_LINEAR` set, every bf16 or int8 layer of a
shape they take gets them; with `LLMOPT_SMALL_BATCH_LINEAR` too, they call llmopt's small-batch
kernels (`small_batch_linear`, `small_batch_int8_linear`), which run up to 64 rows (bf16) or 5 to
32 (int8) themselves and hand the rest to vLLM's; with AMX, the bf16 one alone, up to 4 rows,
handing the rest to vLLM's choice (`small_batch_linear.use_onednn_above`).

Both must hold in vLLM's engine-core process, where the model runs. vLLM's CPU platform starts that
process with `spawn`, so it imports torch and vLLM a second time, after the API server has: 6 of a
precompiled start's 21 s on two cores. Here the core is forked from the API server instead, once
the server has configured the engine: it inherits the imported modules and these fixes, and a
precompiled start of SmolLM2-135M is ready in 16.6 s instead of 21.1, with the same greedy output
(`benchmarks/compile_cache.py`). What vLLM's platform leaves in the environment for the core's
torch to read at import is set on torch directly, so the core compiles the same code under the
same key (vLLM's `VLLM_WORKER_MULTIPROC_METHOD`, also in the key, stays `spawn`), and saved models
are shared with spawned starts. The forked core's main thread gets back its server's cores, which
Intel OpenMP's fork handler narrows to the first: n-gram speculation then ran the model on one
thread (its prefill twice as slow, 2026-11-25). With `LLMOPT_SPAWNED_ENGINE_CORE` set, the core
is spawned as vLLM does it (to measure the difference), and imports these fixes as `__mp_main__`.
"""

from __future__ import annotations

import gc

if __name__ in ("__main__", "__mp_main__"):
    # No collection passes while vLLM, torch and their dependencies are imported (the server's
    # first 9-10 s): tens of thousands of objects made to last, scanned again and again, about 1.5 s
    # of that import on a Zen 3 EPYC. Collection is back before the server starts (vLLM then freezes
    # what its start made, `freeze_gc_heap`).
    gc.disable()

import functools
import importlib
import os
from pathlib import Path
from typing import Any, Callable, Sequence

from llmopt.engine import (attention_calls, avx2_bf16_linear, avx2_int8_linear, kernels, piecewise, prefill_attention,
                           small_batch_int8_linear, small_batch_linear, weight_only_int8_linear)
from llmopt.engine.platform import (INDUCTOR_KERNELS_ENV, KERNEL_REUSED_LINE,
                                   MODEL_INFOS_ENV, PACKED_LINEAR_ENV, PIECEWISE_GRAPH_ENV, SHORT_WARM_UP_LINE,
                                   SPAWNED_CORE_ENV, VLLM_ATTENTION_CALLS_ENV)

FRAME_CHUNK_HEADROOM_WORDS = 1 << 15  # 256 KiB of frame slots: room for the engine core's loop, some 1,400 frames (`_on_a_frame_chunk_of_its_own`)
WARM_UP_TOKENS = 16  # a precompiled start's warm-up pass (vLLM's: its whole batch budget, 2,048 by default)


def _finalized_as_loaded() -> None:
    importlib.import_module("vllm")  # first: vLLM sets torch's environment before torch is imported

    try:
        from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable
    except ImportError:  # a torch without it saves no such functions
        return
    if not hasattr(BundledAOTAutogradSerializableCallable, "finalize_loading"):
        BundledAOTAutogradSerializableCallable.finalize_loading = lambda self, vllm_config: None


def _ngram_keyed_as_plain() -> None:
    """n-gram speculation proposes tokens from the prompt, outside the model: the model's graph is
    the plain one (vLLM's own hash of n-gram settings is one constant, whatever they are), yet
    vLLM keys its saved model by that hash and by a data-parallel synchronisation flag that follows
    from it. Keyed here as without speculation, a model's plain and n-gram starts share one saved
    model, as they share llmopt's compile-cache entry (`compile_cache.components`), and the main
    job's sweep compiles once. Sharing only saves compiles: a key that still differs compiles."""
    import copy

    try:
        from vllm.compilation import caching

        keyed = caching.aot_compile_hash_factors
    except (ImportError, AttributeError):  # another vLLM: its starts compile as it keys them
        return
    if getattr(keyed, "llmopt_ngram_as_plain", False):
        return

    def factors(vllm_config: Any) -> list[str]:
        spec = vllm_config.speculative_config
        if spec is None or spec.method != "ngram":
            return keyed(vllm_config)
        plain = copy.copy(vllm_config)
        parallel = copy.copy(vllm_config.parallel_config)
        object.__setattr__(parallel, "disable_nccl_for_dp_synchronization", True)  # as without speculation
        object.__setattr__(plain, "parallel_config", parallel)
        object.__setattr__(plain, "speculative_config", None)
        return keyed(plain)

    factors.llmopt_ngram_as_plain = True  # type: ignore[attr-defined]
    caching.aot_compile_hash_factors = factors  # imported by name when a model is first called


def _rendezvous_in_socket_folder() -> None:
    """vLLM sets up even a one-process group through a file it makes in the temporary folder,
    named by UUID, and never removes: one a start, about 750 over a few days of this project's
    tests. It goes where vLLM makes its ZeroMQ sockets instead: the folder llmopt gives each server
    (`vllm.socket_folder`), removed when the server stops, or swept once it is gone."""
    import sys
    import uuid

    try:
        from vllm import envs
        from vllm.utils import network_utils
    except ImportError:  # another vLLM: the file stays where it puts it
        return
    if not hasattr(network_utils, "get_file_store_init_method"):
        return

    def in_socket_folder() -> str:
        return f"file://{envs.VLLM_RPC_BASE_PATH}/vllm_dist_{uuid.uuid4().hex}"

    # the executors import it by name: those imported later take this one, any imported already are set
    for name in ("vllm.utils.network_utils", "vllm.v1.executor.uniproc_executor", "vllm.v1.executor.multiproc_executor"):
        if hasattr(sys.modules.get(name), "get_file_store_init_method"):
            sys.modules[name].get_file_store_init_method = in_socket_folder


def _packed_linear_kernels() -> Callable[[int, int, Any], bool]:
    """vLLM's packed kernels for every layer of a shape they take; returns vLLM's own choice."""
    import torch
    from vllm.logger import init_logger
    from vllm.model_executor.kernels.linear.scaled_mm import cpu
    from vllm.model_executor.layers import utils

    logger = init_logger("vllm.llmopt")
    chosen = utils.check_cpu_sgl_kernel

    def packed(n: int, k: int, dtype: torch.dtype) -> bool:
        # the kernels' tiles: 16 channels for bf16; vLLM's int8 kernel has no 16-channel tile and
        # fails on such a layer ("Expected N == BLOCK_N"), so int8 layers need whole blocks of 32
        channels = {torch.bfloat16: 16, torch.int8: 32}.get(dtype)
        if channels and k % 32 == 0 and n % channels == 0:
            logger.info_once("llmopt: vLLM's packed-weight linear kernels for bf16 and int8 layers")
            if dtype == torch.bfloat16 and os.environ.get(small_batch_linear.ENV) == "1":
                rows = small_batch_linear.max_rows(os.environ.get(kernels.LIBRARY_ENV, ""))
                logger.info_once(f"llmopt: its small-batch bf16 linear kernel for up to {rows} rows")
            if dtype == torch.int8 and small_batch_int8_linear.used():
                logger.info_once("llmopt: its small-batch int8 linear kernel for "
                                 f"{small_batch_int8_linear.MIN_ROWS} to {small_batch_int8_linear.MAX_ROWS} rows")
            return True
        return chosen(n, k, dtype)

    utils.check_cpu_sgl_kernel = packed
    cpu.check_cpu_sgl_kernel = packed  # imported by name there
    return chosen


def _forked_engine_core() -> None:
    import multiprocessing

    from torch._inductor import config as inductor
    from vllm.v1.engine import utils
    from vllm.v1.engine.core import EngineCoreProc

    def fork() -> multiprocessing.context.BaseContext:
        # vLLM's CPU platform sets these for the engine core's torch to read at import, which a
        # forked core does not do again; the first changes Inductor's code and vLLM's key for it
        inductor.cpp.dynamic_threads = os.environ.get("TORCHINDUCTOR_CPP_DYNAMIC_THREADS") == "1"
        inductor.compile_threads = int(os.environ.get("TORCHINDUCTOR_COMPILE_THREADS", inductor.compile_threads))
        return multiprocessing.get_context("fork")

    # Intel OpenMP, started in the server, pins a forked child's main thread to the first core of
    # its mask; every thread the core starts inherits that, and numba, imported there by n-gram
    # speculation, sizes itself from it: one thread, which it then sets as OpenMP's count on the
    # model's thread, so the model ran on one core (prefill 2x slower). Registered once, here:
    # vLLM asks for its context more than once
    allowed = os.sched_getaffinity(0)
    os.register_at_fork(after_in_child=lambda: os.sched_setaffinity(0, allowed))
    utils.get_mp_context = fork  # imported by name there, and called once the engine is configured
    EngineCoreProc.run_engine_core = staticmethod(functools.partial(_on_a_frame_chunk_of_its_own, EngineCoreProc.run_engine_core))


def _on_a_frame_chunk_of_its_own(run: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """`run`, its frames in a chunk of Python's frame stack that nothing else ends. CPython keeps a
    thread's frames in chunks (16 KiB, or a power of two that holds a larger frame), and unmaps a
    chunk as soon as the frame that opened it returns. A forked engine core runs its loop on top
    of the server's stack as it stood at the fork, wherever that leaves a chunk's end: on a Zen 4
    EPYC a piecewise graph's step crossed one some 30 times (1,800 mmap and munmap pairs a second,
    none in a spawned core), and decoded at 0.70x of a spawned core (53 against 76 tokens/s at
    c=1). This frame is made to be larger than any chunk's room (`FRAME_CHUNK_HEADROOM_WORDS` slots
    for values it never holds): it opens a chunk of twice that, and every frame of the loop lands
    in the half it leaves free."""
    return run(*args, **kwargs)


_on_a_frame_chunk_of_its_own.__code__ = _on_a_frame_chunk_of_its_own.__code__.replace(co_stacksize=FRAME_CHUNK_HEADROOM_WORDS)


def _shared_inductor_kernels(folder: str) -> None:
    """Every compile-cache entry is compiled in a folder of its own (vLLM points Inductor's cache
    into its saved model), so each compiling start built the same C++ kernels again: SmolLM2's bf16,
    n-gram and chunked-prefill entries have the same 11, SmoothQuant's those and one more. Inductor
    names a kernel's library by the hash of its source and compile command; a library built once is
    kept in `folder` (one per torch version) under that name and copied in where a later compile asks
    for it. Keeping is a favour: where it fails, the start goes on with what it built."""
    import shutil
    import tempfile

    from torch._inductor import codecache
    from torch.utils._filelock import FileLock
    from vllm.logger import init_logger

    logger = init_logger("vllm.llmopt")
    compile_kernels = getattr(codecache, "_worker_compile_cpp", None)
    if compile_kernels is None:  # another torch: its kernels are built as it builds them
        return
    kept = Path(folder)

    def whole_copy(source: Path, target: Path) -> None:
        """A reader finds the whole file or none: Inductor trusts a library that exists. The copy
        takes the source's mode (the temporary file is its owner's alone), so a compile cache
        shared by a group reads it as it reads the libraries Inductor built."""
        with tempfile.NamedTemporaryFile(dir=target.parent, prefix=".part-", delete=False) as part:
            try:
                shutil.copy(source, part.name)
                os.replace(part.name, target)
            finally:
                Path(part.name).unlink(missing_ok=True)

    def compile_or_copy(lock_path: str, builders: Sequence[Any]) -> None:
        library = Path(builders[-1].get_target_file_path())  # the last builder links what the others compiled
        if library.suffix != ".so":  # a precompiled header, which Inductor keeps in a folder of its own
            return compile_kernels(lock_path, builders)
        with FileLock(lock_path, timeout=codecache.LOCK_TIMEOUT):
            if not library.exists() and (kept / library.name).is_file():
                try:
                    whole_copy(kept / library.name, library)
                    logger.info("%s: %s", KERNEL_REUSED_LINE, library.name)
                except OSError as exc:  # then built here, as without it
                    logger.warning("llmopt: Inductor's kept kernel %s not copied in: %s", library.name, exc)
            if library.exists():
                return
        compile_kernels(lock_path, builders)
        try:
            kept.mkdir(parents=True, exist_ok=True)
            whole_copy(library, kept / library.name)
        except OSError as exc:  # a full disk, or the folder pruned meanwhile
            logger.warning("llmopt: Inductor's kernel %s not kept for later compiles: %s", library.name, exc)

    codecache._worker_compile_cpp = compile_or_copy  # looked up by name when Inductor queues a compile


def _shared_model_infos(folder: str) -> None:
    """vLLM learns what a model class supports (`inspect_model_cls`) in a subprocess that imports
    vLLM and torch again, and keeps the answer in its cache root under the hash of the class's
    source file. llmopt gives each compile-cache entry a root of its own, so every entry's first
    start paid that subprocess; the answers go in `folder` instead, which every entry shares."""
    try:
        from vllm.model_executor.models import registry
    except ImportError:  # another vLLM: it keeps them where it keeps them
        return
    if hasattr(getattr(registry, "_LazyRegisteredModel", None), "_get_cache_dir"):
        registry._LazyRegisteredModel._get_cache_dir = staticmethod(lambda: Path(folder))


class _NotLoaded(Exception):
    """The short warm-up met a model with no saved compiled code to load."""


def _short_warm_up_when_loaded() -> None:
    """vLLM's CPU warm-up runs the model over its whole batch budget of dummy tokens: on a start
    that compiles, that pass is the compile, with the budget as Inductor's size hint. Where vLLM
    loads the model it compiled and saved before, the same pass only computes: 3.1-3.4 s of a
    24.6 s precompiled start of SmolLM2-135M in float32 on a Zen 3 EPYC. The pass runs
    `WARM_UP_TOKENS` first; the first load that finds nothing saved stops it before anything is
    compiled, and the full pass runs, so what is compiled and saved is what it always was. With
    more than one rank the pass stays whole: one rank loading and another compiling would run
    collectives of different sizes."""
    from vllm import envs
    from vllm.compilation import decorators
    from vllm.logger import init_logger
    importlib.import_module("vllm.v1.worker.cpu_worker")  # first: it imports vLLM's CPU fixes before the runners
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    load = getattr(decorators, "_try_load_aot_compiled_fn", None)
    if load is None or not envs.VLLM_USE_AOT_COMPILE or envs.VLLM_DISABLE_COMPILE_CACHE:
        return  # a compile that loads nothing saved: the first pass compiles, so it stays whole
    logger = init_logger("vllm.llmopt")
    short = {"on": False, "loaded": False}

    def load_or_stop(model: Any, path: str) -> Any:
        loaded = load(model, path)
        if short["on"]:
            if loaded is None:
                raise _NotLoaded
            short["loaded"] = True
        return loaded

    warm_up = CPUModelRunner.warming_up_model

    def warming_up_model(self: Any) -> None:
        if self.vllm_config.parallel_config.world_size > 1:  # ranks that load and ranks that compile would fall out of step
            return warm_up(self)
        budget = self.max_num_tokens
        short["on"], self.max_num_tokens = True, min(budget, WARM_UP_TOKENS)
        try:
            warm_up(self)
            if short["loaded"]:  # an eager engine warms nothing up
                logger.info("%s: %d tokens", SHORT_WARM_UP_LINE, self.max_num_tokens)
            return
        except _NotLoaded:
            pass
        finally:
            short["on"], self.max_num_tokens = False, budget
        warm_up(self)

    decorators._try_load_aot_compiled_fn = load_or_stop  # called by name on the model's first call
    CPUModelRunner.warming_up_model = warming_up_model


def compiled_graph_from_environment() -> None:
    """The graph llmopt's environment asks Inductor to compile, in this process (a server's, or a
    benchmark's that runs vLLM's offline API): its pieces where `PIECEWISE_GRAPH_ENV` says so."""
    if os.environ.get(PIECEWISE_GRAPH_ENV) == "1":
        piecewise.use()


def kernels_from_environment() -> None:
    """The kernels llmopt's environment asks for, and the lean attention calls (`attention_calls`),
    in this process: the engine core's (a forked core inherits them) or a benchmark's that runs
    vLLM's offline API."""
    import torch

    if torch.cpu._is_amx_tile_supported():
        # Linux gives a process AMX tiles only once it asks (arch_prctl): oneDNN asks as it makes a
        # primitive, vLLM's AMX attention does not, so an eager engine with every layer on the packed
        # kernels (no oneDNN primitive made) died of SIGILL in its first attention
        torch.cpu._init_amx()
    library = os.environ.get(kernels.LIBRARY_ENV)
    if os.environ.get(PACKED_LINEAR_ENV) == "1":
        vllms_choice = _packed_linear_kernels()
        if library and os.environ.get(small_batch_linear.ENV) == "1":
            small_batch_linear.use(library)
            if kernels.library_of(library) is kernels.AVX512:
                small_batch_int8_linear.use(library)
            else:  # with AMX, vLLM's int8 kernel multiplies on its tiles, and oneDNN larger bf16 batches
                small_batch_linear.use_onednn_above(vllms_choice)
    if os.environ.get(weight_only_int8_linear.ENV) == "1":
        weight_only_int8_linear.use()
    if library and os.environ.get(avx2_int8_linear.ENV) == "1":
        avx2_int8_linear.use(library)
    if library and os.environ.get(avx2_bf16_linear.ENV) == "1":
        avx2_bf16_linear.use(library)
    if library and os.environ.get(prefill_attention.ENV) == "1":
        prefill_attention.use(library)
    if os.environ.get(VLLM_ATTENTION_CALLS_ENV) != "1":
        attention_calls.use()


_finalized_as_loaded()
_ngram_keyed_as_plain()
_rendezvous_in_socket_folder()
if __name__ in ("__main__", "__mp_main__"):
    kernels_from_environment()
    if os.environ.get(INDUCTOR_KERNELS_ENV):
        _shared_inductor_kernels(os.environ[INDUCTOR_KERNELS_ENV])
    if os.environ.get(MODEL_INFOS_ENV):
        _shared_model_infos(os.environ[MODEL_INFOS_ENV])
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        _short_warm_up_when_loaded()
        compiled_graph_from_environment()
    if __name__ == "__main__":
        from vllm.entrypoints.launchers.api_server.entry import main
    gc.enable()

if __name__ == "__main__":
    if current_platform.is_cpu() and os.environ.get(SPAWNED_CORE_ENV) != "1":
        _forked_engine_core()
    main()
