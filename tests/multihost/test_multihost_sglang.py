"""SGLang 0.5.23's own receiver on a host of its own, against ``epd-trio encoder --api sglang``
on two others (network namespaces): its ``/scheduler_receive_url`` carries the address it
picks for itself (``SGLANG_HOST_IP``), and each encoder pushes its part there.

The language side is ``tests/sglang``'s driver (SGLang's tokenizer dispatch, a scheduler
rank's registration, PULL socket and part merging), started with ``ip netns exec``.
"""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sglang"))  # SGLang's test kit

import sglang_expected as ref
from conftest import image_uri, random_image
from multihost_cluster import run_recipe, wait_until
from multihost_netns import Network, open_network
from sglang_harness import LanguageServer, SGLangEnv, sglang_env  # noqa: F401 (a fixture)

pytestmark = pytest.mark.slow

ENCODER_START = 240.0
SIZES = [(56, 56), (84, 56), (28, 112)]


@dataclass(frozen=True)
class NamespacedSGLang(SGLangEnv):
    """SGLang's environment, its processes started on one host."""

    netns: str = ""

    def command(self, *args: str) -> list[str]:
        return ["ip", "netns", "exec", self.netns, *super().command(*args)]


@dataclass
class Site:
    net: Network
    language: LanguageServer
    urls: list[str]


def listening(log: Path) -> bool:
    return log.exists() and "listening on http://" in log.read_text(errors="replace")


@pytest.fixture(scope="module")
def site(sglang_env: SGLangEnv,  # the fixture imported above
         checkpoints: dict[str, str],
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    logs = tmp_path_factory.mktemp("multihost_sglang")
    with open_network(["lang", "e1", "e2"]) as net:
        env = {"MODEL": checkpoints["qwen2_5_vl"], "DEVICE": "cpu", "DTYPE": "float32"}
        for label in ("e1", "e2"):
            run_recipe(net[label], "sglang-encoder", env, logs / f"encoder-{label}.log")
        # SGLang's own setting for the address it tells encoders to push to.
        language = LanguageServer(NamespacedSGLang(sglang_env.path, net["lang"].netns), logs,
                                  {"SGLANG_HOST_IP": net["lang"].address})
        try:
            for label in ("e1", "e2"):
                log = logs / f"encoder-{label}.log"
                wait_until(lambda log=log: listening(log), ENCODER_START,  # type: ignore[misc]
                           f"the encoder on {label} listens", interval=0.5)
            yield Site(net, language, [f"http://{net[label].address}:30002" for label in ("e1", "e2")])
        finally:
            language.close()


def test_sglangs_receiver_on_its_own_host_gets_both_parts(site: Site, checkpoints: dict[str, str]) -> None:
    answer, tensors = site.language.request(
        backend="zmq_to_scheduler", rid=uuid.uuid4().hex, urls=site.urls,
        items={"image": [image_uri(w, h, seed=i) for i, (w, h) in enumerate(SIZES)]},
        model_type="qwen2_5_vl")
    assert [r["ok"] for r in answer["ranks"]] == [True], answer
    assert sorted(answer["assigned"]["IMAGE"]) == [1, 2]  # SGLang's own split: a part per encoder
    want = ref.images(checkpoints["qwen2_5_vl"], [random_image(w, h, seed=i)
                                                  for i, (w, h) in enumerate(SIZES)])
    got = tensors["0/IMAGE"]
    assert got.dtype == torch.float32 and got.shape == want.cat().shape
    assert ref.rel_err(got, want.cat()) < 1e-4
    assert answer["dispatch_errors"] == [] and answer["warnings"] == []
