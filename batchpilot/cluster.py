"""Ray, the optional distributed engine (the ``cluster`` extra): importing it with a clear
message when it is missing, joining or starting a cluster, and running Hydra sweep jobs on it
(``scripts/train.py -m hydra/launcher=ray``).

Ray is optional so that the README's set-up stays lean for users on one machine; everything
that needs it goes through ``require_ray`` so its absence reads as one line naming the fix,
never as an ImportError traceback from deep inside a launcher.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

#: What to run when Ray (or the Hydra Ray launcher) is missing.
INSTALL_HINT = "pip install -e '.[cluster]' (scripts/setup.sh installs it)"


class ClusterUnavailable(RuntimeError):
    """Ray is not installed, or the cluster asked for cannot be joined; the message names the
    fix."""


def require_ray(what: str) -> ModuleType:
    """``import ray``, or a ``ClusterUnavailable`` saying that ``what`` needs it and how to
    install it."""
    try:
        import ray
    except ImportError as e:
        raise ClusterUnavailable(f"{what} needs Ray, which is not installed ({e}); {INSTALL_HINT}") from None
    return ray


@contextmanager
def ray_session(
    ray: ModuleType, address: str | None, num_cpus: int | None, init: Mapping[str, Any] | None = None
) -> Iterator[dict[str, float]]:
    """Ray initialised for the ``with`` block; yields the cluster's resources.

    Joins ``address`` (``auto`` = the cluster ``ray start`` runs on this node) or, with None,
    starts a local cluster of ``num_cpus`` CPUs (None = all). A session already initialised by
    the caller (a test fixture, a notebook) is reused and left running; one started here is
    shut down on exit, so no Ray process outlives the run."""
    owned = not ray.is_initialized()
    if owned:
        kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": True, **dict(init or {})}
        if address:
            kwargs["address"] = address
        elif num_cpus is not None:
            kwargs["num_cpus"] = int(num_cpus)
        try:
            ray.init(**kwargs)
        except ConnectionError as e:  # no cluster at that address: a settings problem
            raise ClusterUnavailable(f"could not join the Ray cluster at {address!r}: {e}") from None
    try:
        yield dict(ray.cluster_resources())
    finally:
        if owned:
            ray.shutdown()


# --- Hydra sweeps on Ray (hydra/launcher=ray; the plugin class is scripts/hydra_plugins/) ------
def run_hydra_job(hydra_context: Any, sweep_config: Any, task_function: Any, singleton_state: Any) -> Any:
    """One sweep job inside a Ray worker: Hydra's globals as in the launching process, then
    Hydra's own ``run_job``, so the job's folder, logs and return value are what the basic
    launcher gives."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.core.singleton import Singleton
    from hydra.core.utils import run_job, setup_globals

    setup_globals()
    Singleton.set_state(singleton_state)
    HydraConfig.instance().set_config(sweep_config)
    return run_job(
        hydra_context=hydra_context,
        task_function=task_function,
        config=sweep_config,
        job_dir_key="hydra.sweep.dir",
        job_subdir_key="hydra.sweep.subdir",
    )


def job_cpus(sweep_config: Any, cpus_per_job: float | None) -> float:
    """CPUs Ray reserves for a job: ``cpus_per_job``, or by default the job's own
    ``train.n_envs`` (its rollout workers), 1 where it has none."""
    if cpus_per_job is not None:
        return float(cpus_per_job)
    train = sweep_config.get("train") if hasattr(sweep_config, "get") else None
    n_envs = train.get("n_envs") if train is not None else None
    return float(n_envs) if n_envs else 1.0


def launch_sweep(
    hydra_context: Any,
    config: Any,
    task_function: Any,
    job_overrides: Sequence[Sequence[str]],
    initial_job_idx: int,
    *,
    address: str | None = None,
    num_cpus: int | None = None,
    cpus_per_job: float | None = None,
    init: Mapping[str, Any] | None = None,
) -> list[Any]:
    """Run Hydra sweep jobs as Ray tasks and return their ``JobReturn``s in job order.

    Each job's config is composed here, in the launching process, so workers need no config
    files; the sweep folder must be on storage every node sees (the jobs write into it)."""
    import logging

    from hydra.core.singleton import Singleton
    from hydra.core.utils import configure_log, filter_overrides, setup_globals
    from omegaconf import open_dict

    ray = require_ray("hydra/launcher=ray")
    log = logging.getLogger(__name__)
    setup_globals()
    configure_log(config.hydra.hydra_logging, config.hydra.verbose)
    Path(str(config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
    jobs = []
    for i, overrides in enumerate(job_overrides):
        idx = initial_job_idx + i
        sweep_config = hydra_context.config_loader.load_sweep_config(config, list(overrides))
        with open_dict(sweep_config):
            sweep_config.hydra.job.id = f"{sweep_config.hydra.job.name}_{idx}"
            sweep_config.hydra.job.num = idx
        jobs.append(sweep_config)
        log.info(f"\t#{idx} : {' '.join(filter_overrides(overrides))}")
    state = Singleton.get_state()
    with ray_session(ray, address, num_cpus, init) as resources:
        cpus = resources.get("CPU", 0)
        log.info(f"Ray cluster: {cpus:g} CPUs; {len(jobs)} jobs → {config.hydra.sweep.dir}")
        task = ray.remote(run_hydra_job)
        refs = [
            task.options(num_cpus=job_cpus(sc, cpus_per_job), max_retries=0).remote(
                hydra_context, sc, task_function, state
            )
            for sc in jobs
        ]
        job_of = {ref: sc.hydra.job.num for ref, sc in zip(refs, jobs)}
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            log.info(f"job #{job_of[done[0]]} finished ({len(refs) - len(pending)}/{len(refs)})")
        return list(ray.get(refs))
