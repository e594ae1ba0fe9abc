"""vLLM's OpenAI server as llmopt starts it on this machine: vLLM's own server, with one
compatibility fix so that a precompiled start loads the model vLLM compiled and saved before.

vLLM saves a compiled model whole (Dynamo's trace and Inductor's code, `VLLM_USE_AOT_COMPILE`).
On CPU, vLLM 0.32 compiles with the stock "inductor" backend, whose saved function is torch's
`BundledAOTAutogradSerializableCallable`; loading one calls `finalize_loading`, which only vLLM's
own backend's functions have, so every load fails and the model is traced and compiled again.
Torch's function has loaded everything when it is unpickled: it needs no finalizing, and the fix
gives it a `finalize_loading` that does nothing. A precompiled start of SmolLM2-135M then skips
Dynamo's trace (about 8 s on two cores) and the warm-up takes 4 s instead of 12.

The fix must hold in vLLM's engine-core process too, which multiprocessing spawns: a spawned
process imports the parent's main module again (as `__mp_main__`), so it lives at import time here.
"""

from __future__ import annotations

import importlib


def _finalized_as_loaded() -> None:
    importlib.import_module("vllm")  # first: vLLM sets torch's environment before torch is imported

    try:
        from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable
    except ImportError:  # a torch without it saves no such functions
        return
    if not hasattr(BundledAOTAutogradSerializableCallable, "finalize_loading"):
        BundledAOTAutogradSerializableCallable.finalize_loading = lambda self, vllm_config: None


_finalized_as_loaded()

if __name__ == "__main__":
    from vllm.entrypoints.launchers.api_server.entry import main

    main()
