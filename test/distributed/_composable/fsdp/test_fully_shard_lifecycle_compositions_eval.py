# Owner(s): ["oncall: distributed"]
"""
The chunked loss (``partial_backward``) composed with activation
checkpointing, ``torch.compile``, ``reshard_after_forward=False``,
``register_fsdp_forward_method``, gradient clipping and tensor parallelism,
trained against a non-chunked reference with an evaluation batch after every
step: the evaluation keeps FSDP's post-forward order bounded.

The models and the test mixin are those of
test_fully_shard_lifecycle_compositions.py. Every multi-process test runs
gloo on CPU through ``GlooMultiProcessTestCase``.
"""

import os
import sys

import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import register_fsdp_forward_method
from torch.testing._internal.common_utils import run_tests


sys.path.insert(
    0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
)
from fsdp_lifecycle_testing import GlooMultiProcessTestCase  # noqa: E402
from test_fully_shard_lifecycle_compositions import (  # noqa: E402
    HEAD_LAYOUTS,
    _CompositionTestMixin,
    _make_models,
)


class TestFullyShardChunkedLossCompositions(
    _CompositionTestMixin, GlooMultiProcessTestCase
):
    @property
    def world_size(self) -> int:
        return 2

    def test_activation_checkpointing(self):
        """
        Reentrant and non-reentrant checkpointing around each block (and
        ``checkpoint_wrapper`` inside it) with the chunked loss.
        """
        self.run_subtests(
            {"checkpointing": ["reentrant", "non_reentrant", "wrapper"]},
            self._test_activation_checkpointing,
        )

    def _test_activation_checkpointing(self, checkpointing: str):
        model, ref = _make_models(self._mesh(), checkpointing=checkpointing)
        self._train_and_compare(model, ref, dp_rank=self.rank, dp_size=self.world_size)

    def test_compile_blocks(self):
        """
        Per-block ``torch.compile`` (``aot_eager``) with the chunked loss, with
        the head compiled too or left eager, and with ``checkpoint_wrapper``
        inside each compiled block (torchtitan's order: checkpointing, then
        compile, then ``fully_shard``).
        """
        self.run_subtests(
            {
                "layout": list(HEAD_LAYOUTS),
                # (compile_head, checkpointing): compiling takes most of the
                # time, so two of the four combinations
                "compile_head_and_checkpointing": [(False, None), (True, "wrapper")],
            },
            self._test_compile_blocks,
        )

    def _test_compile_blocks(
        self, layout: str, compile_head_and_checkpointing: tuple[bool, str | None]
    ):
        compile_head, checkpointing = compile_head_and_checkpointing
        torch._dynamo.reset()
        backend = CompileCounterWithBackend("aot_eager")
        model, ref = _make_models(
            self._mesh(),
            layout=layout,
            compile_backend=backend,
            compile_head=compile_head,
            checkpointing=checkpointing,
        )
        self._train_and_compare(model, ref, dp_rank=self.rank, dp_size=self.world_size)
        # The blocks (and the head) ran compiled graphs
        self.assertGreater(backend.frame_count, 0)
        # Checkpointed blocks compile to a higher-order op with a body graph
        graph_targets = [
            node.target
            for graph in backend.graphs
            for module in graph.modules()
            if isinstance(module, torch.fx.GraphModule)
            for node in module.graph.nodes
        ]
        self.assertIn(torch.tanh, graph_targets)
        if compile_head:
            self.assertGreater(backend.frame_count, 1)

    def test_no_reshard_after_forward(self):
        """
        ``reshard_after_forward=False`` on the head group, the root or both,
        and on a root that holds the head, with a trainable or a frozen
        decoder.
        """
        self.run_subtests(
            {
                "layout_head_root": [
                    (layout, head_raf, root_raf)
                    for layout in ("separate", "grouped")
                    for head_raf, root_raf in (
                        (False, None),
                        (None, False),
                        (False, False),
                    )
                ]
                + [("root", None, False)],
                "frozen_decoder": [False, True],
            },
            self._test_no_reshard_after_forward,
        )

    def _test_no_reshard_after_forward(
        self,
        layout_head_root: tuple[str, bool | None, bool | None],
        frozen_decoder: bool,
    ):
        layout, head_raf, root_raf = layout_head_root
        model, ref = _make_models(
            self._mesh(),
            layout=layout,
            head_reshard_after_forward=head_raf,
            root_reshard_after_forward=root_raf,
            frozen_decoder=frozen_decoder,
        )
        if head_raf is False:
            self.assertFalse(model.lm_head.get_fsdp_policy().reshard_after_forward)
        if root_raf is False:
            self.assertFalse(model.get_fsdp_policy().reshard_after_forward)
        self._train_and_compare(model, ref, dp_rank=self.rank, dp_size=self.world_size)

    def test_register_fsdp_forward_method(self):
        """
        Each chunk calls a head method registered with
        ``register_fsdp_forward_method`` instead of the head's forward, with a
        trainable or a frozen decoder.
        """
        self.run_subtests(
            {"layout": list(HEAD_LAYOUTS), "frozen_decoder": [False, True]},
            self._test_register_fsdp_forward_method,
        )

    def _test_register_fsdp_forward_method(self, layout: str, frozen_decoder: bool):
        model, ref = _make_models(
            self._mesh(), layout=layout, frozen_decoder=frozen_decoder
        )
        register_fsdp_forward_method(model.lm_head, "chunk_logits")
        self._train_and_compare(
            model,
            ref,
            dp_rank=self.rank,
            dp_size=self.world_size,
            head=model.lm_head.chunk_logits,
        )

    def test_gradient_clipping(self):
        """
        ``clip_grad_norm_`` on the sharded gradients after each step's
        reduction: the total norm and the clipped gradients match the
        reference's.
        """
        self.run_subtests(
            {"optim_cls": [torch.optim.SGD, torch.optim.AdamW]},
            self._test_gradient_clipping,
        )

    def _test_gradient_clipping(self, optim_cls: type[torch.optim.Optimizer]):
        model, ref = _make_models(self._mesh())
        self._train_and_compare(
            model,
            ref,
            dp_rank=self.rank,
            dp_size=self.world_size,
            optim_cls=optim_cls,
            max_norm=0.1,
        )


class TestFullyShardChunkedLossTensorParallel(
    _CompositionTestMixin, GlooMultiProcessTestCase
):
    @property
    def world_size(self) -> int:
        return 4

    def test_fsdp_tp_chunked_loss(self):
        """
        ``ColwiseParallel`` ``lm_head`` (replicated logits) and column/row
        parallel blocks, then ``fully_shard`` on the data parallel mesh; the
        tensor parallel ranks of one data parallel rank share its data. Also
        with a frozen decoder, and with gradient clipping.
        """
        self.run_subtests(
            {"layout": list(HEAD_LAYOUTS), "frozen_decoder": [False, True]},
            self._test_fsdp_tp_chunked_loss,
        )

    def _test_fsdp_tp_chunked_loss(self, layout: str, frozen_decoder: bool):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        dp_mesh, tp_mesh = mesh["dp"], mesh["tp"]
        model, ref = _make_models(
            dp_mesh, layout=layout, tp_mesh=tp_mesh, frozen_decoder=frozen_decoder
        )
        for name, param in model.named_parameters():
            # Tensor parallel parameters are sharded on both mesh dimensions
            is_tp = name.startswith(("layers.", "lm_head."))
            self.assertEqual(param.device_mesh.ndim, 2 if is_tp else 1, name)
        self._train_and_compare(
            model,
            ref,
            dp_rank=dp_mesh.get_local_rank(),
            dp_size=dp_mesh.size(),
            max_norm=0.1,
        )


if __name__ == "__main__":
    run_tests()
