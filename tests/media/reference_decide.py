"""Child process: Cloudflare's reference (``joint_schema_model.py`` vendored in clef-finetune) answering
requests with images and videos on a release, in fp32 on the CPU, with transformers' own processor
(torchvision through ``tv_shim``).

``python reference_decide.py RELEASE REQUESTS.json OUT.pt``: per request ``{"input_ids", "probs": [per
question, in prompt order], "hidden"}`` or ``{"error": repr}``. Run by ``media_helpers.run_reference_decide``.
"""

from __future__ import annotations

import json
import sys

import torch


def main() -> None:
    release, requests_path, out_path = sys.argv[1:]
    import torchvision  # the shim; a real torchvision here would mean the test is not isolated
    from clef_finetune._vendor import joint_schema_model as jsm
    from reference_processor import use_pyav

    use_pyav()

    assert "tv_shim" in torchvision.__file__, torchvision.__file__
    model, processor = jsm.load_release_model(release, device="cpu", dtype=torch.float32)
    results = []
    for request in json.loads(open(requests_path).read()):
        try:
            with torch.inference_mode():
                encoded = jsm.encode_record(processor.tokenizer, request, processor=processor)
                batch = jsm.collate_records([encoded], processor.tokenizer.pad_token_id, "cpu")
                logits = model(batch)[0]
            results.append({"input_ids": torch.tensor(encoded.input_ids),
                            "probs": [q.float().softmax(-1) for q in logits]})
        except Exception as exc:  # the reference's refusal, compared by the test
            results.append({"error": repr(exc)})
    torch.save(results, out_path)


if __name__ == "__main__":
    main()
