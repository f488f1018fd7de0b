"""Steps that prefill, replayed from CUDA graphs everywhere but in the attention ("piecewise").

A step that prefills cannot be captured whole: its attention depends on how many prompts it
holds, their lengths, the chunks cached before them and which layer groups compress them. What
lies between two attentions (o_proj, the norms, the MLP, the next layer's qkv projection)
depends only on the step's token count, and it is most of an eager step's launches, whose host
time for a 32-layer model exceeded the device time of a 1,024-token chunk (docs/benchmarks.md,
"Engine internals"). So each token-count bucket gets one graph per stretch between attentions
(layers + 1 of them); attention runs eagerly between their replays: it rotates q and k (RoPE) in
place in the static qkv buffer, stores the keys and values, and writes its output to another
static buffer. The pieces never touch the KV cache.

A step runs in the smallest bucket that holds its tokens; the padding rows compute on stale
inputs and nothing reads them (every op between attentions works row by row).
"""

from __future__ import annotations

import torch

from sparse_core.models.attention import StepMetadata
from sparse_core.models.llama import LlamaForCausalLM

# Bucket sizes step by 64 tokens: at most 6% padding for a step of 1,024 tokens or more.
BUCKET_STEP = 64


def token_buckets(max_tokens: int) -> list[int]:
    small = [t for t in (1, 8, 16, 32) if t < max_tokens]
    return sorted({*small, *range(BUCKET_STEP, max_tokens, BUCKET_STEP), max_tokens})


class PiecewiseGraphs:
    def __init__(
        self,
        model: LlamaForCausalLM,
        max_tokens: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.buckets = token_buckets(max_tokens)
        attention = model.model.layers[0].self_attn
        hidden = model.config.hidden_size
        dtype = model.lm_head.weight.dtype
        m = self.buckets[-1]
        # Zeroed once: a padding row then only ever holds finite values.
        self.input_ids = torch.zeros(m, dtype=torch.int64, device=device)
        self.qkv = torch.zeros(m, sum(attention.split), dtype=dtype, device=device)
        self.residual = torch.zeros(m, hidden, dtype=dtype, device=device)
        self.attn_out = torch.zeros(m, attention.split[0], dtype=dtype, device=device)
        self.hidden = torch.zeros(m, hidden, dtype=dtype, device=device)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}

    @property
    def max_tokens(self) -> int:
        return self.buckets[-1]

    def run_piece(self, piece: int, tokens: int) -> None:
        """`LlamaForCausalLM.piece` on the first `tokens` rows of the static buffers."""
        rows = slice(0, tokens)
        out, residual = self.model.piece(
            piece,
            input_ids=self.input_ids[rows],
            attn_out=self.attn_out[rows],
            residual=self.residual[rows],
        )
        if residual is None:  # the last piece
            self.hidden[rows].copy_(out)
            return
        self.qkv[rows].copy_(out)
        self.residual[rows].copy_(residual)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: StepMetadata
    ) -> torch.Tensor:
        """The model's forward pass (hidden states [T, hidden], a view into a static buffer)
        for T <= max_tokens tokens. Before `capture` (and on CPU, where the tests run it) the
        pieces run eagerly, on the same buffers and padding."""
        tokens = input_ids.shape[0]
        bucket = next(b for b in self.buckets if b >= tokens)
        self.input_ids[:tokens].copy_(input_ids)
        graphs = self.graphs.get(bucket)
        layers = self.model.model.layers
        for piece in range(self.model.num_pieces):
            if graphs is not None:
                graphs[piece].replay()
            else:
                self.run_piece(piece, bucket)
            if piece < len(layers):
                attn_out = layers[piece].self_attn.attend(positions, self.qkv[:tokens], meta)
                self.attn_out[:tokens].copy_(attn_out)
        return self.hidden[:tokens]

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket's pieces, largest first so the smaller ones reuse its memory (a
        pool of their own: a piece's outputs are copied to the static buffers, and the rest of
        its tensors die with its replay)."""
        pool = None
        for bucket in reversed(self.buckets):
            for piece in range(self.model.num_pieces):  # warm-up: Triton compiles outside the graph
                self.run_piece(piece, bucket)
            torch.cuda.synchronize()
            graphs = []
            for piece in range(self.model.num_pieces):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.run_piece(piece, bucket)
                pool = graph.pool()
                graphs.append(graph)
            self.graphs[bucket] = graphs
        torch.cuda.synchronize()
