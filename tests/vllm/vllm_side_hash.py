"""Run by the vLLM venv's Python (never the project's): vLLM's own mm_hash of items.

Reads a JSON list of ``{"modality", "path", "model_id", "video_processor"?,
"uuid"?}`` from stdin; prints the list of hashes vLLM 0.32 gives them, each
item loaded the way its chat server loads a content part (MediaConnector on a
data: URL), parsed by its data parser, hashed by ``ProcessorInputs.get_mm_hashes``
(``MultiModalHasher``).
"""

from __future__ import annotations

import base64
import json
import sys

from vllm.multimodal.media.connector import MediaConnector
from vllm.multimodal.parse import MultiModalDataParser
from vllm.multimodal.processing.inputs import ProcessorInputs

MIME = {"image": "image/png", "video": "video/mp4", "audio": "audio/wav"}


def load(connector: MediaConnector, case: dict) -> object:
    with open(case["path"], "rb") as f:
        url = f"data:{MIME[case['modality']]};base64,{base64.b64encode(f.read()).decode()}"
    if case["modality"] == "image":
        return connector.fetch_image(url)
    if case["modality"] == "video":
        return connector.fetch_video(url, video_processor=case.get("video_processor"))
    return connector.fetch_audio(url)


def main() -> None:
    out = []
    connector = MediaConnector()
    for case in json.load(sys.stdin):
        parser = MultiModalDataParser(target_sr=16000,
                                      video_needs_metadata=case.get("video_needs_metadata", False))
        items = parser.parse_mm_data({case["modality"]: [load(connector, case)]})
        uuids = {case["modality"]: [case.get("uuid")]}
        inputs = ProcessorInputs(prompt=[], mm_data_items=items, mm_uuid_items=uuids)
        hashes = inputs.get_mm_hashes(case["model_id"], case.get("algorithm", "blake3"))
        out.append(hashes[case["modality"]][0])
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
