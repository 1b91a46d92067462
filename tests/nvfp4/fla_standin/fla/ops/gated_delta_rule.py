"""The stand-in's two kernels (see ``fla/__init__.py``)."""

import os


def _reference(name):
    from transformers.models.qwen3_5 import modeling_qwen3_5

    fn = getattr(modeling_qwen3_5, name)
    while hasattr(fn, "__wrapped__"):  # transformers' wrapper around its own torch function
        fn = fn.__wrapped__
    return fn


def _count(name):
    with open(os.environ["FLA_STANDIN_LOG"], "a", encoding="utf-8") as log:
        log.write(name + "\n")


def chunk_gated_delta_rule(query, key, value, g=None, beta=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False):
    _count("chunk_gated_delta_rule")
    return _reference("torch_chunk_gated_delta_rule")(query, key, value, g=g, beta=beta, initial_state=initial_state,
                                                      output_final_state=output_final_state,
                                                      use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)


def fused_recurrent_gated_delta_rule(query, key, value, g=None, beta=None, initial_state=None,
                                     output_final_state=False, use_qk_l2norm_in_kernel=False):
    _count("fused_recurrent_gated_delta_rule")
    return _reference("torch_recurrent_gated_delta_rule")(query, key, value, g=g, beta=beta,
                                                          initial_state=initial_state,
                                                          output_final_state=output_final_state,
                                                          use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
