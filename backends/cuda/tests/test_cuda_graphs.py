"""The decode-graph path (static buffers, padded batches) on the CPU, with a stand-in for the
CUDA graph that replays the captured function eagerly."""

from __future__ import annotations

from collections.abc import Callable

import torch
from engine_core_cuda._cuda_graphs import DecodeGraphs, graph_batch_sizes
from hf_reference import PROMPTS, greedy
from tiny_models import TinyModel

from engine_core import SamplingParams


class EagerGraphs(DecodeGraphs):
    """Records the forward function instead of a CUDA graph; replays write the same static
    output tensor, as a graph replay does."""

    def _record(
        self, forward: Callable[[], torch.Tensor]
    ) -> tuple[Callable[[], None], torch.Tensor]:
        output = forward()
        self.replays = getattr(self, "replays", 0)

        def replay() -> None:
            self.replays += 1
            output.copy_(forward())

        return replay, output


def test_graph_batch_sizes() -> None:
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(5) == [1, 2, 4, 5]
    assert graph_batch_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert graph_batch_sizes(256)[-3:] == [224, 240, 256]


def test_padded_decode_batches_equal_transformers(tiny: dict[str, TinyModel]) -> None:
    model = tiny["qwen2"]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with model.llm(block_size=8) as llm:
        runner = llm._client.engine_core.backend.runner
        graphs = EagerGraphs(runner, [1, 2, 4])
        graphs.capture()
        runner.graphs = graphs
        # Three requests decode in the graph of 4 (one padding sequence), the last one alone in
        # the graph of 1 once the others have finished.
        outputs = llm.generate(
            PROMPTS[:3],
            [params, params, params.clone(max_tokens=12)],
            use_tqdm=False,
        )
    assert graphs.replays >= 7 + 4
    # Every batch size writes its logits into the rows of one shared buffer.
    assert {output.data_ptr() for _, output in graphs._graphs.values()} == {
        graphs.logits.data_ptr()
    }
    assert graphs.reserved_bytes == graphs.logits.numel() * 4  # on the CPU: just the buffer
    for out in outputs:
        expected = greedy(model.hf, out.prompt_token_ids, len(out.outputs[0].token_ids))
        assert out.outputs[0].token_ids == expected
