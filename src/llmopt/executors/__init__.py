"""Executors: where a job's worker runs. `local` (the default) starts it as a background process on
this machine; `ray` submits it as a Ray job (see `base.Executor` for what one does)."""

from __future__ import annotations

from llmopt.errors import LlmoptError
from llmopt.executors import local, ray
from llmopt.executors.base import ACTIVE, STATUSES, STOP_GRACE_S, Ended, Executor, Resources, Worker, settle

NAMES = ("local", "ray")

__all__ = ["ACTIVE", "NAMES", "STATUSES", "STOP_GRACE_S", "Ended", "Executor", "Resources", "Worker", "choose", "of", "settle"]


def choose(name: str, ray_address: str | None = None) -> Executor:
    """The executor a new job asks for, checked before anything is recorded (Ray: installed here,
    and its cluster answering at `ray_address`)."""
    if name == "local":
        if ray_address is not None:
            raise LlmoptError("--ray-address is for the Ray executor", "pass --executor ray too, or leave --ray-address out")
        return local.LocalExecutor()
    if name == "ray":
        chosen = ray.RayExecutor(ray.dashboard_address(ray_address))
        chosen.check()
        return chosen
    raise LlmoptError(f"unknown executor '{name}'", f"use one of {', '.join(NAMES)}")


def of(worker: Worker) -> Executor:
    """The executor that runs a recorded job."""
    if worker.executor == "ray":
        return ray.RayExecutor(worker.ray_address or ray.DEFAULT_ADDRESS)
    return local.LocalExecutor()
