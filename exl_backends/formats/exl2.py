"""EXL2 (ExLlamaV2) linear layers: reading and validating the packed tensors. Layout: shared/design/exl2-format.md."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..errors import CheckpointError
from ..model import reference
from .tensors import TensorStore

EXL2_BITS = (2, 3, 4, 5, 6, 8)


def padded(n: int) -> int:
    """ExLlamaV2 pads every linear's out_features to a multiple of 32."""
    return (n + 31) // 32 * 32


@dataclass
class Exl2Weight:
    q_weight: Tensor      # int32 [QR, Np]
    q_scale: Tensor       # int32 [G, Np/8]
    q_scale_max: Tensor   # fp16 [G]
    q_groups: Tensor      # int16 [2G]: (bits, qrow_start) per group
    q_invperm: Tensor     # int32 [K]: stored row of original row k
    in_features: int
    out_features: int

    @property
    def device(self) -> torch.device:
        return self.q_weight.device

    def tensors(self) -> dict[str, Tensor]:
        return {"q_weight": self.q_weight, "q_scale": self.q_scale, "q_scale_max": self.q_scale_max,
                "q_groups": self.q_groups, "q_invperm": self.q_invperm}

    def dequantize(self) -> Tensor:
        t = {k: v.cpu() for k, v in self.tensors().items()}
        return reference.dequant_exl2(t["q_weight"], t["q_scale"], t["q_scale_max"], t["q_groups"],
                                      t["q_invperm"], self.out_features).to(self.device)

    def groups(self) -> list[tuple[int, int, int]]:
        return reference.exl2_groups(self.q_groups.cpu(), self.in_features)

    def to(self, device: torch.device) -> "Exl2Weight":
        return Exl2Weight(**{k: v.to(device) for k, v in self.tensors().items()},
                          in_features=self.in_features, out_features=self.out_features)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())


def check(store: TensorStore, key: str, k: int, n: int) -> None:
    """Validates names, shapes and dtypes of one layer's packed tensors without reading data. A `q_perm` that
    older files carry is not read: like ExLlamaV2, we always derive the permutation from q_invperm."""
    np_ = padded(n)
    sm = store.expect(f"{key}.q_scale_max", None, (torch.float16,))
    if len(sm.shape) != 1 or sm.shape[0] == 0:
        raise CheckpointError(f"{sm.file}: tensor '{key}.q_scale_max' has shape {list(sm.shape)}, expected "
                              f"[groups]")
    groups = sm.shape[0]
    store.expect(f"{key}.q_scale", (groups, np_ // 8), (torch.int32,))
    store.expect(f"{key}.q_groups", (2 * groups,), (torch.int16,))
    store.expect(f"{key}.q_invperm", (k,), (torch.int32,))
    qw = store.expect(f"{key}.q_weight", None, (torch.int32,))
    if len(qw.shape) != 2 or qw.shape[1] != np_:
        raise CheckpointError(f"{qw.file}: tensor '{key}.q_weight' has shape {list(qw.shape)}, expected "
                              f"[packed rows, {np_}] for out_features {n} from config.json (padded to 32)")


def _check_content(w: Exl2Weight, key: str, store: TensorStore) -> None:
    """q_groups must cut K rows into groups of non-increasing width that fill q_weight exactly; q_invperm must
    be a permutation; q_scale_max finite. Checked before anything is unpacked."""
    def bad(tensor, why):
        return CheckpointError(f"{store.info(f'{key}.{tensor}').file}: tensor '{key}.{tensor}': {why}; the "
                               f"checkpoint is corrupt, re-download or re-convert it")
    pairs = w.q_groups.to(torch.int64).view(-1, 2).tolist()
    bits = [b for b, _ in pairs]
    if any(b not in EXL2_BITS for b in bits):
        raise bad("q_groups", f"bit widths {sorted(set(bits))}, allowed {list(EXL2_BITS)}")
    if any(a < b for a, b in zip(bits, bits[1:])):
        raise bad("q_groups", f"bit widths {bits} are not in non-increasing order")
    if pairs[0][1] != 0:
        raise bad("q_groups", f"the first group starts at packed row {pairs[0][1]}, not 0")
    rows = 0
    for i, ((b, start), (_, nxt)) in enumerate(zip(pairs, pairs[1:])):
        if nxt <= start or (nxt - start) * 32 % b:
            raise bad("q_groups", f"group {i} ({b}-bit) spans packed rows {start}..{nxt}, not a whole number of "
                                  f"rows")
        rows += (nxt - start) * 32 // b
    b, start = pairs[-1]
    last = w.in_features - rows
    if last <= 0 or last * b % 32:
        raise bad("q_groups", f"the groups before the last cover {rows} rows, which leaves {last} rows of "
                              f"{b}-bit codes for in_features {w.in_features}")
    if start + last * b // 32 != w.q_weight.shape[0]:
        raise bad("q_weight", f"{w.q_weight.shape[0]} packed rows, but q_groups describe "
                              f"{start + last * b // 32}")
    perm = w.q_invperm.to(torch.int64)          # K values in 0..K-1, each once (a count, not a sort: 10x faster)
    if not (bool(perm.min() >= 0) and bool(perm.max() < w.in_features)
            and bool(torch.bincount(perm, minlength=w.in_features).eq(1).all())):
        raise bad("q_invperm", f"not a permutation of 0..{w.in_features - 1}")
    if not torch.isfinite(w.q_scale_max).all():
        raise bad("q_scale_max", "holds inf/NaN")


def load(store: TensorStore, key: str, k: int, n: int) -> Exl2Weight:
    check(store, key, k, n)
    w = Exl2Weight(*(store.get(f"{key}.{t}") for t in ("q_weight", "q_scale", "q_scale_max", "q_groups",
                                                      "q_invperm")), in_features=k, out_features=n)
    _check_content(w, key, store)
    return w
