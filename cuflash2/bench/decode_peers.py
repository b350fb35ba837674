"""torch SDPA's decoding next to cuflash2's: `bench --decode --compare torch`.

The peers are SDPA's FlashAttention-2 backend and its cuDNN backend, one query token against
(b, h_kv, s, d) views of the same caches (`enable_gqa` where the heads differ). SDPA has no KV
cache: it attends over the whole cache, the appended token's slot included (cuflash2's call
wrote that token there before), and appends nothing. A single step is timed as cuflash2's, L2
flushed before each call; its output is compared with cuflash2's. In a graph, a peer's step is
`decode_graph.LAYERS` layers of the SDPA call over the in-graph step's own caches, each
followed by the same stand-in kernel (`next_layer_inputs.cu`) reading the layer's output and
writing the next q, captured with torch's CUDA graphs and replayed with L2 flushed before it.
A backend that refuses a row leaves its time empty and the reason in `<key>_error`.
"""

from __future__ import annotations

import warnings

from .decode_graph import LAYERS, launch_next_layer_inputs
from .timing import time_cupy
from .torch_peers import TorchSdpaCudnn, TorchSdpaFlash, max_abs_diff, refusal_reason

#: (key in the rows, the backend: a torch_peers.TorchSdpa with its LABEL and BACKEND).
PEERS = (("sdpa_flash", TorchSdpaFlash), ("cudnn", TorchSdpaCudnn))

SINGLE_STEP_NOTE = (
    "SDPA's columns: torch SDPA restricted to its FlashAttention-2 backend (SDPA-flash) and to "
    "its cuDNN backend, on (b, h, s, d) views of the same caches (enable_gqa where the heads "
    "differ), attending over the whole cache, the token cuflash2 appended included; SDPA "
    "appends nothing. Each time with cuflash2's speed-up over it in parentheses.")
GRAPH_NOTE = (
    "SDPA's columns: the same layers over the same caches, each an SDPA call followed by the "
    "same kernel between layers, captured with torch's CUDA graphs (SDPA appends nothing).")


def _each_peer(cupy, torch, row: dict, dtype_name: str, fields, measure) -> None:
    """For each of PEERS: `measure(key, peer)` fills row[key + field] for `fields`; where the
    backend refuses, they stay None and row[key + "_error"] says why (as torch_peers.measure_cudnn
    does for the main grid)."""
    for key, backend in PEERS:
        row.update({key + field: None for field in fields + ("_error",)})
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                measure(key, backend(torch, cupy, dtype_name))
            except Exception as exc:
                row.update({key + field: None for field in fields})
                row[key + "_error"] = refusal_reason(exc, [str(w.message) for w in caught])


def measure_single(cupy, torch, row: dict, q, k_cache, v_cache, ours_out, warmup, iters,
                   backlog, flush_l2) -> None:
    """Each peer's single step into `row` (a decode row, with its "dtype"): `<key>_us`,
    `<key>_max_abs_diff` (against `ours_out`, whose call appended the token the peer reads), or
    `<key>_error`."""
    def measure(key, peer):
        qt, kt, vt = (peer.as_bhsd(x) for x in (q, k_cache, v_cache))
        ms = time_cupy(cupy, lambda: peer.attend_all(qt, kt, vt), warmup, iters, backlog,
                       flush_l2)
        row[f"{key}_us"] = ms * 1e3
        row[f"{key}_max_abs_diff"] = max_abs_diff(cupy, torch, ours_out,
                                                  peer.attend_all(qt, kt, vt))

    _each_peer(cupy, torch, row, row["dtype"], ("_us", "_max_abs_diff"), measure)


class PeerDecodeStep:
    """An SDPA call (`peer`, a torch_peers.TorchSdpa) over each of `caches` (cuflash2 arrays), each
    followed by the stand-in kernel, captured as a torch CUDA graph on a stream of its own."""

    def __init__(self, cupy, torch, peer, q, k_new, v_new, caches):
        self.cupy, self.torch, self.peer = cupy, torch, peer
        self.q, self.k_new, self.v_new = q, k_new, v_new
        self.q_bhsd = peer.as_bhsd(q)
        self.caches = [(peer.as_bhsd(k), peer.as_bhsd(v)) for k, v in caches]
        self.stream = torch.cuda.Stream()
        with torch.cuda.stream(self.stream):
            self._record()  # compiles the stand-in and warms the backend before the capture
        self.stream.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=self.stream):
            self._record()
        self.stream.synchronize()

    def _record(self) -> None:
        cupy = self.cupy
        for k_cache, v_cache in self.caches:
            out = self.peer.attend_all(self.q_bhsd, k_cache, v_cache)
            with cupy.cuda.ExternalStream(self.torch.cuda.current_stream().cuda_stream):
                launch_next_layer_inputs(cupy, _cupy_view(cupy, out, self.q.dtype), self.q,
                                         self.k_new, self.v_new)

    def run(self) -> None:
        self.graph.replay()


def _cupy_view(cupy, tensor, dtype):
    """A cupy array over a contiguous torch tensor's memory (no synchronisation, so it may be
    made while a graph is being captured)."""
    memory = cupy.cuda.UnownedMemory(tensor.data_ptr(), tensor.numel() * tensor.element_size(),
                                     tensor, tensor.device.index)
    return cupy.ndarray((tensor.numel(),), dtype, cupy.cuda.MemoryPointer(memory, 0))


def measure_graph(cupy, torch, row: dict, step, warmup, iters, backlog, flush_l2) -> None:
    """Each peer's in-graph step over `step`'s caches (a decode_graph.DecodeStep) into
    `row` (an in-graph row, with its "dtype"): `<key>_us_per_layer` or `<key>_error`."""
    def measure(key, peer):
        peer_step = PeerDecodeStep(cupy, torch, peer, step.q, step.k, step.v, step.caches)
        with torch.cuda.stream(peer_step.stream), \
                cupy.cuda.ExternalStream(peer_step.stream.cuda_stream):
            ms = time_cupy(cupy, peer_step.run, warmup, iters, backlog, flush_l2)
        row[f"{key}_us_per_layer"] = ms * 1e3 / LAYERS

    _each_peer(cupy, torch, row, row["dtype"], ("_us_per_layer",), measure)


def has_peers(rows: list[dict], suffix: str) -> bool:
    """Whether the rows were measured with the peers (their `<key><suffix>` fields)."""
    return any(PEERS[0][0] + suffix in r for r in rows)


def peer_cells(row: dict, suffix: str, ours: float, digits: int) -> list[str]:
    """Table cells of the peers' times (`<key><suffix>`) with cuflash2's speed-up over each,
    or "n/a" where the backend refused."""
    cells = []
    for key, _ in PEERS:
        theirs = row.get(f"{key}{suffix}")
        if theirs is None:
            cells.append("n/a" if row.get(f"{key}_error") else "–")
        else:
            cells.append(f"{theirs:.{digits}f} ({theirs / ours:.2f}x)")
    return cells


def peer_headers(what: str) -> list[str]:
    return [f"{peer.LABEL} {what}" for _, peer in PEERS]


def peer_notes(rows: list[dict], note: str, table: str) -> list[str]:
    """`note`, then one line per backend and reason for the rows a backend refused."""
    refused = {}
    for row in rows:
        for key, peer in PEERS:
            reason = row.get(f"{key}_error")
            if reason:
                refused.setdefault((peer.LABEL, reason), []).append(
                    f"b={row['batch']} cache={row['cache']} h={row['nheads']}/{row['nheads_kv']}")
    return [note] + [f"{label} n/a in the {table} ({', '.join(where)}): {reason}"
                     for (label, reason), where in refused.items()]
