"""kvsparse's sparsity inside stock vLLM, through its `vllm.general_plugins` entry point.

vLLM calls `register` in every process it starts. Nothing here imports vLLM at module level,
so `sparse_core` works without it. See docs/vllm_plugin.md.
"""

from __future__ import annotations


def register() -> None:
    import vllm

    from sparse_core.vllm_plugin.hooks import install
    from sparse_core.vllm_plugin.version import check_vllm_version

    check_vllm_version(vllm.__version__)
    install()
