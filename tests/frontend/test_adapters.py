"""The adapter store: names, stable task ids, the model names that reach an adapter, and one upload at a time."""
import asyncio
import json
import shutil

import numpy as np
import pytest

from backend.lora.peft import save_trtllm
from frontend.adapters import MAX_TASK_ID, AdapterStore, derived_task_id, scan
from frontend.errors import OpenAIError


def write_adapter(path, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    save_trtllm(path, rng.standard_normal((2, 8 * 64)).astype(np.float16), np.array([[1, 0, 4], [3, 1, 4]], np.int32))


@pytest.fixture()
def store_dir(tmp_path):
    for name, seed in (("7", 0), ("alpha", 1), ("beta", 2), ("named", 3)):
        write_adapter(tmp_path / name, seed)
    (tmp_path / "not-an-adapter").mkdir()
    (tmp_path / "manifest.json").write_text(json.dumps({"pinned": {"path": "named", "task_id": 42}}))
    return tmp_path


def test_numbered_folders_keep_their_number_and_the_manifest_its_ids(store_dir):
    found = scan(store_dir)
    assert set(found) == {"7", "alpha", "beta", "pinned"}
    assert found["7"][1] == 7 and found["pinned"][1] == 42


def test_derived_ids_follow_name_and_content_and_survive_a_copy(store_dir, tmp_path_factory):
    found = scan(store_dir)
    assert found["alpha"][1] != found["beta"][1]
    assert all(0 <= task_id <= MAX_TASK_ID for _, task_id in found.values())
    elsewhere = tmp_path_factory.mktemp("replica")
    shutil.copytree(store_dir, elsewhere, dirs_exist_ok=True)
    assert {name: task_id for name, (_, task_id) in scan(elsewhere).items()} == \
        {name: task_id for name, (_, task_id) in found.items()}          # another replica, the same ids
    renamed = elsewhere / "gamma"
    (elsewhere / "alpha").rename(renamed)
    assert derived_task_id("gamma", renamed) != found["alpha"][1]
    write_adapter(elsewhere / "beta", seed=9)                          # new weights under an old name
    assert derived_task_id("beta", elsewhere / "beta") != found["beta"][1]


def test_model_names_reach_the_base_an_adapter_or_nothing(store_dir):
    store = AdapterStore(store_dir, "base", "_lora_")
    assert store.resolve("base") is None
    assert store.resolve("alpha").task_id == store.resolve("base_lora_alpha").task_id
    for name in ("gamma", "base_lora_gamma", "alpha_lora_base", ""):
        with pytest.raises(OpenAIError) as err:
            store.resolve(name)
        assert err.value.status == 404 and err.value.param == "model"


def test_load_and_unload_at_run_time(store_dir, tmp_path_factory):
    store = AdapterStore(None, "base")
    assert store.adapters == {}
    extra = tmp_path_factory.mktemp("extra") / "a"
    write_adapter(extra, seed=5)
    adapter = store.load("fresh", str(extra))
    assert store.resolve("fresh") is adapter and adapter.task_id == derived_task_id("fresh", extra)
    for name, path, param in (("fresh", str(extra), "lora_name"), ("base", str(extra), "lora_name"),
                              ("bad/name", str(extra), "lora_name"), ("other", str(store_dir), "lora_path")):
        with pytest.raises(OpenAIError) as err:
            store.load(name, path)
        assert err.value.status == 400 and err.value.param == param
    store.unload("fresh")
    with pytest.raises(OpenAIError):
        store.resolve("fresh")
    with pytest.raises(OpenAIError) as err:
        store.unload("fresh")
    assert err.value.status == 404


def test_weights_travel_once_however_many_requests_arrive_together(store_dir):
    adapter = AdapterStore(store_dir, "base").resolve("alpha")

    async def scenario():
        async def request(outcome):
            upload = await adapter.begin()
            if upload is not None:
                await asyncio.sleep(0.01)            # the upload's first answer takes a while
                adapter.end(upload, accepted=outcome.pop(0))
            return upload is not None

        outcome = [False, True]                      # the first upload fails, the second is accepted
        carried = await asyncio.gather(*(request(outcome) for _ in range(6)))
        later = await adapter.begin()
        adapter.forget()                             # the core answered "not found": upload again
        again = await adapter.begin()
        return carried, later, again

    carried, later, again = asyncio.run(scenario())
    assert sum(carried) == 2 and carried[:2] == [True, True]
    assert later is None and again is not None
