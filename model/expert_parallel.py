"""Expert parallelism: one replica's routed experts spread over N ranks of a torch.distributed group.

    rank 0 (driver): the whole model, its state and generate(); each MoE layer's dispatcher exchanges tokens
    ranks 1..N-1 (expert servers): experts [first, end) of every layer, waiting for the driver's rounds

Notable choices:
- Experts are split in contiguous ranges (`expert_range`); N must divide num_experts (`check_expert_parallel`).
  Every rank loads the dense weights too (they are small next to the experts) but only rank 0 runs them.
- Lockstep without mirroring: only rank 0 runs forward passes. Each MoE call on rank 0 is one *round*: a header
  all-to-all (the layer index and per-expert row counts), an all-to-all of the token rows to the ranks owning
  their experts, the grouped expert MLPs there, and an all-to-all back. Workers loop on rounds, so they need no
  state, no token ids and no knowledge of generate(); the caller's `generate(model, ...)` is unchanged.
  The exchange is symmetric (any rank may send rows), so data-parallel dense layers could later use it as is.
- Failures are bounded in time: the gloo/NCCL timeout bounds every round; a dead peer fails a round at once
  (connection reset). While the driver is idle a keepalive thread sends empty rounds, so an idle worker never
  times out and a dead worker is noticed before the next document. Any failure is an `ExpertParallelError`;
  `ExpertParallelReplica.generate` then restarts the workers and reruns the whole call (no partial results).
- The collective is chosen once, here: `all_to_all_single` where the backend has it, else paired send/recv.

Shapes: N tokens, D hidden, E experts in the model, L experts per rank, W world size, P routed pairs.

Why one file of about 540 lines: the ranks' process group, the token exchange, the keepalive and the restart
rules are one protocol; a reader follows a round from the driver to the workers and back in one place.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

from . import kernels
from .clover import CloverModel
from .config import CloverConfig
from .moe import Experts, Routing, SparseMoE, dispatch, expert_mlp

log = logging.getLogger(__name__)

# Header op codes (a layer index is >= 0). REPORT: every rank then sends its expert parameter count.
STOP, PING, FOLLOW, REPORT = -1, -2, -3, -4


class ExpertParallelError(RuntimeError):
    """A rank of an expert-parallel replica died, hung past the timeout, or left the group."""


def check_expert_parallel(config: CloverConfig, n: int) -> None:
    """Raise ValueError unless `n` ranks can split the config's experts evenly."""
    if n < 1:
        raise ValueError(f"expert_parallel must be >= 1, got {n}")
    if config.num_experts % n:
        fits = [d for d in range(1, config.num_experts + 1) if config.num_experts % d == 0]
        raise ValueError(f"expert_parallel={n} does not divide num_experts={config.num_experts} of model "
                         f"{config.name!r}; use one of {fits}")


def expert_range(rank: int, world: int, num_experts: int) -> tuple[int, int]:
    """The contiguous experts [first, end) that `rank` of `world` holds."""
    if num_experts % world:
        raise ValueError(f"expert_parallel={world} does not divide num_experts={num_experts}")
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in [0, {world})")
    per = num_experts // world
    return rank * per, (rank + 1) * per


def expert_numel(model: CloverModel) -> int:
    """Elements of routed-expert parameters this rank holds (for memory checks)."""
    return sum(p.numel() for m in model.modules() if isinstance(m, Experts) for p in m.parameters())


# ---- the exchange, chosen once ------------------------------------------------------------------------------------
Exchange = Callable[[torch.Tensor, torch.Tensor, list[int], list[int], Any], None]


def _all_to_all_single(out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int],
                       group: Any) -> None:
    dist.all_to_all_single(out, inp, out_splits, in_splits, group=group)


def _send_recv(out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int],
               group: Any) -> None:
    """all_to_all_single from paired isend/irecv, for backends without it; empty chunks are not sent."""
    rank = dist.get_rank(group)
    outs, ins = out.split(out_splits), inp.split(in_splits)
    outs[rank].copy_(ins[rank])
    reqs = []
    for peer in range(len(out_splits)):
        if peer == rank:
            continue
        if ins[peer].numel():
            reqs.append(dist.isend(ins[peer].contiguous(), dst=peer, group=group))
        if outs[peer].numel():
            buf = outs[peer]
            reqs.append(dist.irecv(buf, src=peer, group=group))
    for r in reqs:
        r.wait()


EXCHANGES: dict[str, Exchange] = {"all_to_all": _all_to_all_single, "send_recv": _send_recv}


def _pick_exchange(group: Any, choice: str, device: torch.device) -> str:
    """One probe all ranks run together: all_to_all_single if the backend supports it."""
    if choice != "auto":
        if choice not in EXCHANGES:
            raise ValueError(f"exchange must be 'auto' or one of {sorted(EXCHANGES)}, got {choice!r}")
        return choice
    world = dist.get_world_size(group)
    probe = torch.zeros(world, dtype=torch.int64, device=device)
    try:
        dist.all_to_all_single(torch.empty_like(probe), probe, group=group)
    except (RuntimeError, NotImplementedError) as e:  # an unsupported op fails on every rank before any traffic
        log.info("all_to_all_single unavailable on %s (%s); using send/recv", dist.get_backend(group), e)
        return "send_recv"
    return "all_to_all"


# ---- the group ----------------------------------------------------------------------------------------------------
@dataclass
class ExpertGroup:
    """This rank's view of an expert-parallel group: one round at a time (a lock), and a keepalive on rank 0."""

    group: Any  # the torch.distributed process group
    rank: int
    world: int
    exchange_name: str
    timeout_s: float
    per_rank: int = 0  # experts each rank holds (every header carries one count per expert), set on apply/serve
    last_report: list[int] = field(default_factory=list)  # expert parameter elements per rank, from REPORT
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    lock: threading.Lock = field(default_factory=threading.Lock)
    failure: BaseException | None = None
    last_round: float = field(default_factory=time.monotonic)
    _stop: threading.Event = field(default_factory=threading.Event)
    _keepalive: threading.Thread | None = None

    def exchange(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> None:
        EXCHANGES[self.exchange_name](out, inp, out_splits, in_splits, self.group)

    def headers(self, send_WH: torch.Tensor) -> torch.Tensor:
        """Equal-size int64 rows, one per rank, swapped: row r of the result came from rank r."""
        recv = torch.empty_like(send_WH)
        self.exchange(recv.view(-1), send_WH.reshape(-1), [send_WH.shape[1]] * self.world,
                      [send_WH.shape[1]] * self.world)
        return recv

    def guarded(self, what: str, fn: Callable[[], Any]) -> Any:
        """Run one round under the lock; any communication failure becomes ExpertParallelError."""
        with self.lock:
            if self.failure is not None:
                raise ExpertParallelError(f"expert-parallel group is broken: {self.failure}") from self.failure
            try:
                result = fn()
            except ExpertParallelError:
                raise
            except RuntimeError as e:  # gloo/NCCL: peer closed the connection, or the timeout passed
                self.failure = e
                raise ExpertParallelError(
                    f"rank {self.rank} of {self.world}: {what} failed (a rank died or hung over {self.timeout_s:g}s): "
                    f"{str(e).splitlines()[0].split('. This is typically')[0][:300]}") from e
            self.last_round = time.monotonic()
            return result

    def start_keepalive(self, interval_s: float) -> None:
        """Rank 0: send an empty round whenever no round ran for `interval_s` (idle workers must not time out)."""

        def loop() -> None:
            while not self._stop.wait(interval_s / 4):
                if time.monotonic() - self.last_round < interval_s or self.failure is not None:
                    continue
                try:
                    self.guarded("keepalive", lambda: self.headers(self._header(PING)))
                except ExpertParallelError as e:
                    log.warning("%s", e)

        self._keepalive = threading.Thread(target=loop, name="expert-parallel-keepalive", daemon=True)
        self._keepalive.start()

    def _header(self, op: int, counts_WL: torch.Tensor | None = None) -> torch.Tensor:
        h = torch.zeros(self.world, 1 + self.per_rank, dtype=torch.int64)
        h[:, 0] = op
        if counts_WL is not None:
            h[:, 1:] = counts_WL
        return h.to(self.device)  # NCCL exchanges CUDA tensors only

    def close(self) -> None:
        """Rank 0: stop the keepalive, tell the workers to stop (if the group still works), leave the group."""
        self._stop.set()
        if self._keepalive is not None:
            self._keepalive.join()
        if self.failure is None:
            try:
                self.guarded("stop", lambda: self.headers(self._header(STOP)))
            except ExpertParallelError as e:
                log.warning("%s", e)
        if dist.is_initialized():
            dist.destroy_process_group()


def init_group(rank: int, world: int, store: dist.Store, *, timeout_s: float, device: str | torch.device = "cpu",
               backend: str | None = None, exchange: str = "auto") -> ExpertGroup:
    """Join the default process group (one replica per process) through `store`, and pick the exchange.

    The backend follows this rank's device, not the machine: NCCL for CUDA ranks, gloo for CPU ranks (a CPU replica
    on a GPU host stays on gloo)."""
    if dist.is_initialized():
        raise RuntimeError("this process already belongs to a torch.distributed group; one replica per process")
    device = torch.device(device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        torch.cuda.set_device(device)
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    group = dist.group.WORLD
    return ExpertGroup(group, rank, world, _pick_exchange(group, exchange, device), timeout_s, device=device)


def join_store(host: str, port: int, world: int, *, join_timeout_s: float) -> dist.Store:
    """A worker's client of rank 0's rendezvous store (the join may wait while ranks load their weights)."""
    return dist.TCPStore(host, port, world, is_master=False, timeout=datetime.timedelta(seconds=join_timeout_s))


# ---- one round ----------------------------------------------------------------------------------------------------
def _round(g: ExpertGroup, op: int, x_ND: torch.Tensor, routing: Routing | None, experts_by_layer: list[Experts],
           ) -> tuple[int, torch.Tensor | None]:
    """Run one round from this rank's side; returns (the driver's op, this rank's combined output or None).

    The driver passes op = its layer index with its tokens; a worker passes FOLLOW with no tokens and serves the
    layer named by the driver's header.
    """
    W, dev = g.world, x_ND.device
    E_local = experts_by_layer[0].num_local
    E = E_local * W
    k = routing.experts.shape[1] if routing is not None else 0
    if routing is not None:
        d = dispatch(routing.experts, E, 0)  # all pairs sorted by global expert = by destination rank
        counts_E = torch.diff(d.offsets.to(torch.int64), prepend=torch.zeros(1, dtype=torch.int64, device=dev))
    else:
        d, counts_E = None, torch.zeros(E, dtype=torch.int64)
    hdr = g.headers(g._header(op, counts_E.cpu().view(W, E_local)))  # [W, 1 + L]
    driver_op = int(hdr[0, 0])
    if driver_op == REPORT:  # measured here, in this rank's process, from the modules it holds
        numel = sum(p.numel() for e in experts_by_layer for p in e.parameters())
        g.last_report = g.headers(g._header(numel))[:, 0].tolist()
    if driver_op < 0:
        return driver_op, None
    experts = experts_by_layer[driver_op]
    recv_counts_WL = hdr[:, 1:]
    send_splits = counts_E.view(W, E_local).sum(1).tolist()
    recv_splits = recv_counts_WL.sum(1).tolist()
    D = x_ND.shape[1]

    x_PD = x_ND[d.order // k] if d is not None else x_ND.new_empty(0, D)
    rows_RD = x_ND.new_empty(sum(recv_splits), D)
    g.exchange(rows_RD, x_PD, recv_splits, send_splits)

    # Rows arrive grouped by source, then by local expert: regroup by expert for the grouped GEMMs.
    local_ids = torch.arange(E_local, device=dev).repeat(W).repeat_interleave(recv_counts_WL.reshape(-1).to(dev))
    perm = torch.argsort(local_ids, stable=True)
    offsets = torch.bincount(local_ids, minlength=E_local).cumsum(0).to(torch.int32)
    y_sorted = expert_mlp(rows_RD[perm], experts.gate_up_proj, experts.down_proj, offsets)
    y_RD = torch.empty_like(y_sorted)
    y_RD[perm] = y_sorted

    back_PD = x_ND.new_empty(sum(send_splits), D)
    g.exchange(back_PD, y_RD, send_splits, recv_splits)
    if d is None or routing is None:
        return driver_op, None
    w = routing.weights.reshape(-1)[d.order].unsqueeze(-1)
    out = x_ND.new_zeros(x_ND.shape[0], D)
    return driver_op, out.index_add_(0, d.order // k, back_PD * w)


def expert_numel_per_rank(model: CloverModel, group: ExpertGroup) -> list[int]:
    """Driver: ask every rank how many routed-expert parameter elements it holds."""
    experts = [m.experts for m in _moe_layers(model)]
    empty = torch.empty(0, model.config.hidden_size, dtype=model.dtype, device=model.device)
    group.guarded("report", lambda: _round(group, REPORT, empty, None, experts))
    return list(group.last_report)


class ExpertParallelDispatcher:
    """The driver's dispatcher for one MoE layer: each call is one round over the group."""

    def __init__(self, group: ExpertGroup, layer: int, experts_by_layer: list[Experts]) -> None:
        self.group, self.layer, self.experts_by_layer = group, layer, experts_by_layer

    def __call__(self, x_ND: torch.Tensor, routing: Routing, experts: Experts) -> torch.Tensor:
        _, out = self.group.guarded(f"layer {self.layer} expert exchange",
                                    lambda: _round(self.group, self.layer, x_ND, routing, self.experts_by_layer))
        return out


def _moe_layers(model: CloverModel) -> list[SparseMoE]:
    return [m for m in model.modules() if isinstance(m, SparseMoE)]


def apply_expert_parallel(model: CloverModel, group: ExpertGroup) -> CloverModel:
    """Swap an ExpertParallelDispatcher into every SparseMoE of the driver's model (in place)."""
    moes = _moe_layers(model)
    _check_experts(model, group)
    experts = [m.experts for m in moes]
    for i, moe in enumerate(moes):
        moe.dispatcher = ExpertParallelDispatcher(group, i, experts)
    return model


def _check_experts(model: CloverModel, group: ExpertGroup) -> None:
    want = expert_range(group.rank, group.world, model.config.num_experts)
    group.per_rank = want[1] - want[0]
    for i, moe in enumerate(_moe_layers(model)):
        have = (moe.experts.first_expert, moe.experts.first_expert + moe.experts.num_local)
        if have != want:
            raise ValueError(f"MoE layer {i} holds experts {have}, but rank {group.rank} of {group.world} owns {want}")


def serve_experts(model: CloverModel, group: ExpertGroup) -> int:
    """A worker's loop: serve the driver's rounds until it says stop; returns the number of rounds served."""
    _check_experts(model, group)
    experts = [m.experts for m in _moe_layers(model)]
    empty = torch.empty(0, model.config.hidden_size, dtype=model.dtype, device=model.device)
    served = 0
    with torch.inference_mode():
        while True:
            op, _ = group.guarded("serving", lambda: _round(group, FOLLOW, empty, None, experts))
            if op == STOP:
                return served
            served += op >= 0


# ---- a replica: rank 0 plus workers started by a launcher ----------------------------------------------------------
@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker rank needs to load its experts and join (plain values: it crosses processes)."""

    source: str
    world: int
    host: str  # rank 0's rendezvous store
    port: int
    dtype: str = "float32"  # float32 | bfloat16
    device: str = "cpu"
    timeout_s: float = 60.0  # bound on one collective: a dead or hung rank fails a round within this
    join_timeout_s: float = 600.0  # bound on forming the group (ranks load their weights first)
    num_threads: int = 1
    exchange: str = "auto"
    overrides: dict | None = None


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def rank_device(device: str, rank: int) -> str:
    """A rank's device: "cuda" means the rank-th visible GPU when several are visible (local processes), the only
    one when Ray gives each rank its own (CUDA_VISIBLE_DEVICES); CPU stays CPU."""
    if torch.device(device).type != "cuda" or torch.device(device).index is not None:
        return device
    return f"cuda:{rank % max(1, torch.cuda.device_count())}"


def run_worker(spec: WorkerSpec, rank: int) -> int:
    """Body of a worker rank (a process or a Ray actor): load experts, join, serve until stopped."""
    from . import load_config, load_model

    kernels.model_threads(spec.num_threads)
    config = load_config(spec.source, spec.overrides)
    device = rank_device(spec.device, rank)
    model = load_model(spec.source, device=device, dtype=DTYPES[spec.dtype],
                       expert_range=expert_range(rank, spec.world, config.num_experts), overrides=spec.overrides)
    store = join_store(spec.host, spec.port, spec.world, join_timeout_s=spec.join_timeout_s)
    store.set(f"loaded/{rank}", "1")
    group = init_group(rank, spec.world, store, timeout_s=spec.timeout_s, device=device, exchange=spec.exchange)
    try:
        served = serve_experts(model, group)
        log.info("expert rank %d/%d stopped after %d rounds", rank, spec.world, served)
        return served
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class Launcher(Protocol):
    """Starts and stops ranks 1..world-1 of a replica (processes here, Ray actors in pipeline/)."""

    def start(self, spec: WorkerSpec) -> None: ...

    def failure(self) -> str | None:
        """A description of a worker that has exited, if any."""

    def stop(self) -> None: ...


class ProcessLauncher:
    """Workers as local processes (spawned: no inherited threads or CUDA context)."""

    def __init__(self, start_method: str = "spawn") -> None:
        import multiprocessing as mp

        self.ctx = mp.get_context(start_method)
        self.procs: list[Any] = []

    def start(self, spec: WorkerSpec) -> None:
        self.procs = [self.ctx.Process(target=run_worker, args=(spec, r), name=f"expert-rank-{r}", daemon=True)
                      for r in range(1, spec.world)]
        for p in self.procs:
            p.start()

    def failure(self) -> str | None:
        dead = [f"rank {i + 1} (pid {p.pid}) exited with {p.exitcode}" for i, p in enumerate(self.procs)
                if p.exitcode is not None]
        return "; ".join(dead) or None

    def stop(self) -> None:
        for p in self.procs:
            p.join(timeout=2)
            if p.is_alive():
                p.kill()
                p.join()
        self.procs = []


class ExpertParallelReplica:
    """Rank 0 of a replica: holds the driver model (`.model`) and restarts the workers when one fails.

    `generate(prompts, **opts)` is `clover_batch.model.generate` on the driver model; if the group breaks during
    the call, the workers are restarted and the whole call rerun (at most `max_restarts` times), so a caller
    gets each prompt's output once or an ExpertParallelError.
    """

    def __init__(self, source: str, world: int, launcher: Launcher, *, dtype: str = "float32", device: str = "cpu",
                 timeout_s: float = 60.0, join_timeout_s: float = 600.0, num_threads: int = 1, max_restarts: int = 2,
                 exchange: str = "auto", host: str = "127.0.0.1", overrides: dict | None = None) -> None:
        from . import load_config, load_model

        config = load_config(source, overrides)
        check_expert_parallel(config, world)
        self.source, self.world, self.launcher = str(source), world, launcher
        self.dtype, self.device, self.timeout_s, self.num_threads = dtype, device, timeout_s, num_threads
        self.join_timeout_s = join_timeout_s
        self.max_restarts, self.exchange, self.host, self.overrides = max_restarts, exchange, host, overrides
        self.restarts = 0
        self.model = load_model(source, device=device, dtype=DTYPES[dtype], overrides=overrides,
                                expert_range=expert_range(0, world, config.num_experts))
        self.group: ExpertGroup | None = None
        for attempt in range(max_restarts + 1):
            try:
                self._connect()
                break
            except ExpertParallelError as e:
                if attempt == max_restarts:
                    raise
                log.warning("%s; starting the workers again", e)
                self.restarts += 1

    def _connect(self) -> None:
        store = dist.TCPStore(self.host, 0, self.world, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=self.join_timeout_s))
        spec = WorkerSpec(self.source, self.world, self.host, store.port, self.dtype, self.device, self.timeout_s,
                          self.join_timeout_s, self.num_threads, self.exchange, self.overrides)
        self.launcher.start(spec)
        try:
            self._wait_loaded(store)
            self.group = init_group(0, self.world, store, timeout_s=self.timeout_s, device=self.model.device,
                                    exchange=self.exchange)
        except RuntimeError as e:
            self.launcher.stop()
            raise ExpertParallelError(f"expert-parallel replica of {self.world} ranks did not form: {e}; "
                                      f"workers: {self.launcher.failure() or 'no exit seen'}") from e
        apply_expert_parallel(self.model, self.group)
        self.group.start_keepalive(self.timeout_s / 3)
        log.info("expert-parallel replica up: %d ranks, store %s:%d, exchange %s", self.world, self.host,
                 store.port, self.group.exchange_name)

    def _wait_loaded(self, store: dist.Store) -> None:
        """Wait (up to join_timeout_s) for every worker to load its experts; a worker that exits fails at once."""
        keys = [f"loaded/{r}" for r in range(1, self.world)]
        deadline = time.monotonic() + self.join_timeout_s
        while not store.check(keys):  # polled: a timed-out store.wait makes c10d print warnings every second
            failure = self.launcher.failure()
            if failure:
                raise RuntimeError(f"a worker exited while loading: {failure}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"workers did not load within {self.join_timeout_s:g}s")
            time.sleep(0.05)

    def _dead_worker(self, grace_s: float = 2.0) -> str | None:
        """Which worker exited, waiting briefly: a reset connection can be seen before the exit is."""
        deadline = time.monotonic() + grace_s
        while (why := self.launcher.failure()) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return why

    def restart(self) -> None:
        """Tear the group down (workers killed) and form it again with fresh workers."""
        if self.group is not None:
            self.group.close()
            self.group = None
        self.launcher.stop()
        self.restarts += 1
        self._connect()

    def generate(self, prompts: list[list[int]], options: Any = None, **overrides: Any) -> list:
        from .generate import generate

        for attempt in range(self.max_restarts + 1):
            try:
                if self.group is None or self.group.failure is not None:
                    self.restart()
                return generate(self.model, prompts, options, **overrides)
            except ExpertParallelError as e:
                why = self._dead_worker()
                if attempt == self.max_restarts:
                    raise ExpertParallelError(f"{e} (workers: {why or 'no exit seen'}); gave up after "
                                              f"{self.max_restarts} restarts") from e
                log.warning("expert-parallel replica failed (%s; workers: %s); restarting and retrying %d prompts",
                            e, why or "no exit seen", len(prompts))
                self.restart()
        raise AssertionError("unreachable")

    def expert_numel_per_rank(self) -> list[int]:
        """Routed-expert parameter elements held by each rank, measured in each rank's process."""
        if self.group is None:
            raise ExpertParallelError("the replica is closed")
        return expert_numel_per_rank(self.model, self.group)

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None
        self.launcher.stop()


def local_replica(source: str, world: int, *, start_method: str = "spawn", **kwargs: Any) -> ExpertParallelReplica:
    """A replica whose workers are local processes (tests, benchmarks, one machine without Ray)."""
    return ExpertParallelReplica(source, world, ProcessLauncher(start_method), **kwargs)
