"""How exact the loss's gradient can be, by how the chunk's logits are stored (CPU, float64 reference; issue 27).

For G = softmax(z) - onehot(y) and the bf16 operand of the dX = G @ W and dW = G^T @ h matmuls (accumulated in
fp32 here, as on the tensor cores), the relative L2 error of dX and dW against float64, on data like
bench_lm_loss.py's (logits std ~4, labels drawn from the softmax):

  bf16 logits          today's path: z rounded to bf16 (cuBLAS output), softmax in fp32, G rounded to bf16
  fp32 logits          z kept in fp32, G rounded once to bf16
  scaled exp, 1 round  a GEMM epilogue's scheme: E = bf16(exp(z - k)) per (row, tile of TILE columns), k the tile's
                       max rounded up to a multiple of ln 2, so that rescaling E to the row's reference is a power
                       of two (exact); the per-row factor exp(m - lse) and the one-hot term applied in fp32 (on the
                       dX output rows and the dW operand rows; the one-hot part a gather / scatter of rows)
  scaled exp, 2 rounds the same E, then the per-row factor folded into the operand and rounded to bf16 again

The matmul outputs stay fp32 here (on a GPU, rounding dX and dW to bf16 adds its own ~1e-3), and so does the dW
operand h * factor of "1 round" (a GEMM would apply the factor in fp32 in its operand load, or round it).

    python benchmarks/numerics_grad_storage.py [--rows 256 --hidden 2048 --vocab 65536]   # ~25 s on 2 cores
"""
from __future__ import annotations

import argparse
import math

import torch


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=65536)
    parser.add_argument("--tile", type=int, default=256, help="columns per epilogue tile")
    args = parser.parse_args()
    n, v, tile = args.rows, args.vocab, args.tile
    torch.manual_seed(0)
    bf16 = torch.bfloat16
    h = torch.randn(n, args.hidden).to(bf16)
    w = (torch.randn(v, args.hidden) * (4.0 / math.sqrt(args.hidden))).to(bf16)
    z64 = h.double() @ w.double().T
    y = torch.multinomial(torch.softmax(z64, -1).float(), 1).squeeze(1)
    onehot = torch.nn.functional.one_hot(y, v).float()
    g64 = torch.softmax(z64, -1) - onehot.double()
    dx64, dw64 = g64 @ w.double(), g64.T @ h.double()
    z = h.float() @ w.float().T  # the fp32 accumulator

    def errors(dx: torch.Tensor, dw: torch.Tensor) -> str:
        return f"dX {rel(dx.double(), dx64):.2e}  dW {rel(dw.double(), dw64):.2e}"

    def of_operand(g: torch.Tensor) -> str:
        return errors(g.float() @ w.float(), g.float().T @ h.float())

    print(f"rows {n}, hidden {args.hidden}, vocab {v}, tile {tile}")
    print("bf16 logits          " + of_operand((torch.softmax(z.to(bf16).float(), -1) - onehot).to(bf16)))
    print("fp32 logits          " + of_operand((torch.softmax(z, -1) - onehot).to(bf16)))
    tiles = z.view(n, v // tile, tile)
    k = torch.ceil(tiles.amax(-1, keepdim=True) / math.log(2)) * math.log(2)
    e = torch.exp(tiles - k).to(bf16)  # one rounding, of a number in (0, 1]
    row_k = k.amax(1, keepdim=True)
    operand = (e.float() * torch.exp2(torch.round((k - row_k) / math.log(2)))).to(bf16).view(n, v)  # exact
    row_factor = torch.exp(row_k.view(n, 1) - torch.logsumexp(z, -1, keepdim=True))
    dx = (operand.float() @ w.float()) * row_factor - w.float()[y]
    dw = (operand.float().T @ (h.float() * row_factor)).index_add_(0, y, -h.float())
    print("scaled exp, 1 round  " + errors(dx, dw))
    print("scaled exp, 2 rounds " + of_operand((operand.float() * row_factor - onehot).to(bf16)))


if __name__ == "__main__":
    main()
