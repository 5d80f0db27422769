"""Every role of a tensor-parallel launch: rank 0's engine, the target's worker ranks, the speculator rank.

Rank 0 decides the :class:`~ssd_eagle.config.EngineConfig` (from its command line) and shares it once over the
default group (:func:`share_config`); every other rank then follows it (:func:`run_follower`). Rank 0's
:class:`DriverSession` builds the engine -- a plain :class:`~ssd_eagle.engine.llm_engine.LLMEngine` whose target
runner broadcasts each forward (:class:`~ssd_eagle.parallel.runner.DriverRunner`) and whose SSD drafter talks to the
speculator rank (:class:`~ssd_eagle.parallel.speculator.JoinedSpeculator`) -- and, whatever happens, releases the
other ranks when it closes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ssd_eagle.engine.factory import build
from ssd_eagle.engine.llm_engine import LLMEngine
from ssd_eagle.model_runner import ModelRunner
from ssd_eagle.parallel.runner import (DriverRunner, recv_geometry, send_geometry, use_local_kv_cache,
                                       worker_loop)
from ssd_eagle.parallel.sharding import load_sharded_model
from ssd_eagle.parallel.speculator import JoinedSpeculator, decline_speculator, run_speculator_rank
from ssd_eagle.parallel.topology import SPECULATOR, Topology


def share_config(config=None):
    """Rank 0 sends ``config`` (an :class:`~ssd_eagle.config.EngineConfig`, or None: nothing to run) to every rank;
    the others call it without arguments and get it back."""
    box = [config]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def check_config(config, topo: Topology) -> None:
    """Raises ValueError when the launch's shape does not fit the config (a speculator rank iff mode ``ssd``)."""
    if topo.has_speculator and config.mode != "ssd":
        raise ValueError(f"this launch has a speculator rank ({topo.world_size} processes for --tp {topo.tp_size}) "
                         f"but --mode is {config.mode!r}; use {topo.tp_size} processes or --mode ssd")
    if config.mode == "ssd" and not topo.has_speculator:
        raise ValueError(f"--mode ssd needs {topo.tp_size + 1} processes (the speculator is rank {topo.tp_size}), "
                         f"got {topo.world_size}")


def _load_target(config, topo: Topology):
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    device = topo.device(config.device)
    return load_sharded_model(config.model, topo, config.torch_dtype, device), device


class DriverSession:
    """Rank 0's side of a launch, and the placement (:mod:`ssd_eagle.engine.factory`) of its engine: the target
    sharded over ranks 0 .. N-1, the SSD speculator rank N. :meth:`build_engine` is a drop-in for
    :func:`ssd_eagle.engine.llm.build_engine`; :meth:`close` (always call it) shuts the engine's helpers down and
    releases every other rank.

    Args:
        topo: the launch (this must be rank 0).
    """

    captures = False  # each forward is broadcast to the other ranks first

    def __init__(self, topo: Topology):
        if topo.rank != 0:
            raise ValueError("the driver session runs on rank 0")
        self.topo = topo
        self.config = None
        self.engine: LLMEngine | None = None
        self._speculator: JoinedSpeculator | None = None
        self._speculator_started = False
        self._geometry_sent = False
        self._device = torch.device("cpu")

    def build_engine(self, config, model=None) -> LLMEngine:
        """Share ``config``, load this rank's shard of the target (unless ``model`` is given), build the drafter and
        the engine, and start the worker ranks.

        Raises:
            ValueError: the launch does not fit the config, or anything :func:`ssd_eagle.engine.factory.build`
                raises (bad drafter, heads not divisible by the TP size, ...).
            RuntimeError: called twice.
        """
        if self.config is not None:
            raise RuntimeError("a launch builds one engine")
        check_config(config, self.topo)
        self.config = share_config(config)
        if model is not None:
            self._device = next(model.parameters()).device
        self.engine = build(config, model, self)
        return self.engine

    # the placement
    def load_target(self, config):
        from transformers import AutoTokenizer

        from ssd_eagle.assets import resolve_model_path

        model, self._device = _load_target(config, self.topo)
        return model, AutoTokenizer.from_pretrained(resolve_model_path(config.model))

    def draft(self, spec, target) -> None:
        return None  # the speculator rank loads its own

    def speculator(self, config, settings, target, draft) -> JoinedSpeculator:
        spec = config.speculative_config
        param = next(target.parameters())
        cuda = param.device.type == "cuda"
        settings.dist_backend = "nccl" if cuda else "gloo"
        embedding = target.get_input_embeddings().weight if spec.method == "eagle3" else None
        self._speculator_started = True
        self._speculator = JoinedSpeculator(settings, spec, target.config, self.topo.pair_group,
                                            embedding=embedding, timeout=spec.speculator_timeout,
                                            device=param.device if cuda else "cpu")
        return self._speculator

    def attach(self, engine: LLMEngine) -> LLMEngine:
        if self.topo.tp_size > 1:
            engine.target = DriverRunner(use_local_kv_cache(engine.target), self.topo.tp_group)
            send_geometry(self.topo.tp_group, self._device, engine.max_num_seqs, engine.target.kv.max_len)
            self._geometry_sent = True
        return engine

    def close(self) -> None:
        """Stop the speculator rank and the worker ranks (or tell them nothing will run). Idempotent."""
        topo = self.topo
        if self.config is None:
            self.config = False
            share_config(None)
            return
        if self.config is False:
            return
        self.config = False
        if topo.has_speculator:
            if self._speculator is not None:
                self._speculator.close()
            elif not self._speculator_started:
                decline_speculator(topo)
        if topo.tp_size > 1:
            if self._geometry_sent:
                self.engine.target.shutdown()
            else:
                send_geometry(topo.tp_group, self._device, 0, 0)


def run_worker(config, topo: Topology, model=None) -> int:
    """Ranks 1 .. N-1: load this rank's shard (unless given) and replay rank 0's forwards until it shuts down.
    Returns the number of forwards (0 when rank 0 built no engine)."""
    if model is None:
        model, device = _load_target(config, topo)
    else:
        device = next(model.parameters()).device
    num_slots, max_len = recv_geometry(topo.tp_group, device)
    if num_slots == 0:
        return 0
    runner = use_local_kv_cache(ModelRunner(model, num_slots, max_len, initial_capacity=1))
    return worker_loop(runner, topo.tp_group)


def run_follower(topo: Topology) -> bool:
    """Every rank but 0: receive the config and play this rank's role until rank 0 releases it. Returns False when
    rank 0 had nothing to run."""
    config = share_config()
    if config is None:
        return False
    if topo.role == SPECULATOR:
        return run_speculator_rank(topo, config.device)
    run_worker(config, topo)
    return True
