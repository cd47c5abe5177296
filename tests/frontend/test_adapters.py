"""The adapter store: names, stable task ids, the model names that reach an adapter, one upload at a time, and
adapters loaded at run time only from the allowed roots, only when valid, one load of a name at a time."""
import asyncio
import json
import shutil

import numpy as np
import pytest

from backend.lora.peft import save_trtllm
from backend.model.checkpoint import ModelConfig
from frontend.adapters import MAX_TASK_ID, AdapterStore, content_digest, derived_task_id, scan
from frontend.errors import OpenAIError
from frontend.tensors import AdapterInvalid, AdapterLimits


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
    assert derived_task_id("gamma", content_digest(renamed)) != found["alpha"][1]
    write_adapter(elsewhere / "beta", seed=9)                          # new weights under an old name
    assert derived_task_id("beta", content_digest(elsewhere / "beta")) != found["beta"][1]


def test_model_names_reach_the_base_an_adapter_or_nothing(store_dir):
    store = AdapterStore(store_dir, "base", "_lora_")
    assert store.resolve("base") is None
    assert store.resolve("alpha").task_id == store.resolve("base_lora_alpha").task_id
    for name in ("gamma", "base_lora_gamma", "alpha_lora_base", ""):
        with pytest.raises(OpenAIError) as err:
            store.resolve(name)
        assert err.value.status == 404 and err.value.param == "model"


LIMITS = AdapterLimits(ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], "vocab_size": 128,
                                             "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                                             "num_attention_heads": 4, "num_key_value_heads": 2,
                                             "max_position_embeddings": 256, "rms_norm_eps": 1e-5}), max_lora_rank=8)


@pytest.fixture()
def roots(tmp_path_factory):
    """An adapter store, a second allowed root and a folder outside both, each with a valid adapter."""
    base = tmp_path_factory.mktemp("roots")
    for folder in ("store/kept", "allowed/extra", "outside/evil"):
        write_adapter(base / folder, seed=len(folder))
    return base


def loaded(store: AdapterStore, name: str, path: str):
    return asyncio.run(store.load(name, path))


def refusal(store: AdapterStore, name: str, path: str) -> OpenAIError:
    """The 400 a load gets; nothing is registered."""
    before = dict(store.adapters)
    with pytest.raises(OpenAIError) as err:
        loaded(store, name, path)
    assert err.value.status == 400 and store.adapters == before
    return err.value


def test_load_and_unload_at_run_time(roots):
    store = AdapterStore(roots / "store", "base", roots=(str(roots / "allowed"),), limits=LIMITS)
    adapter = loaded(store, "fresh", str(roots / "allowed/extra"))
    assert store.resolve("fresh") is adapter
    assert adapter.task_id == derived_task_id("fresh", content_digest(roots / "allowed/extra"))
    assert loaded(store, "relative", "kept").path == roots / "store/kept"      # relative to the store
    for name, path, param in (("fresh", "kept", "lora_name"), ("base", "kept", "lora_name"),
                              ("bad/name", "kept", "lora_name"), ("other", str(roots / "store"), "lora_path")):
        assert refusal(store, name, path).param == param
    store.unload("fresh")
    with pytest.raises(OpenAIError):
        store.resolve("fresh")
    with pytest.raises(OpenAIError) as err:
        store.unload("fresh")
    assert err.value.status == 404


def test_the_stores_own_adapters_cannot_be_unloaded(roots):
    store = AdapterStore(roots / "store", "base", limits=LIMITS)
    with pytest.raises(OpenAIError) as err:
        store.unload("kept")
    assert err.value.status == 400 and "adapter store" in err.value.message and "kept" in store.adapters


def test_paths_outside_the_roots_are_refused(roots):
    store = AdapterStore(roots / "store", "base", roots=(str(roots / "allowed"),), limits=LIMITS)
    (roots / "store/link-out").symlink_to(roots / "outside/evil")                   # a folder that leads out
    inside = roots / "store/file-link"
    inside.mkdir()
    (inside / "adapter_config.json").symlink_to(roots / "outside/evil/model.lora_config.npy")   # a file that does
    for path in (str(roots / "outside/evil"), "../outside/evil", "../allowed/../outside/evil", "link-out",
                 "file-link", "/etc", ""):
        err = refusal(store, "x", path)
        assert err.param == "lora_path" and str(roots) not in err.message.replace(repr(path), "")
    assert refusal(AdapterStore(None, "base", limits=LIMITS), "x", str(roots / "allowed/extra")).param == "lora_path"


@pytest.mark.parametrize("breakage, words", [
    ("junk weights", "model.lora_weights.npy"), ("junk config", "model.lora_config.npy"), ("bad json", "adapter_config.json"), ("nan", "NaN"),
    ("rank", "rank 9"), ("layer", "layer 2"), ("module", "module 9"), ("short row", "needs")])
def test_a_broken_adapter_is_refused_naming_what_is_wrong_and_not_registered(roots, breakage, words):
    folder = roots / "allowed/broken"
    write_adapter(folder)
    weights, config = np.load(folder / "model.lora_weights.npy"), np.load(folder / "model.lora_config.npy")
    if breakage == "junk weights":
        (folder / "model.lora_weights.npy").write_bytes(b"not numpy lora_weights")
    elif breakage == "junk config":
        (folder / "model.lora_config.npy").write_bytes(b"\x93NUMPY\x01\x00garbage lora_config")
    elif breakage == "bad json":
        (folder / "adapter_config.json").write_text("{not json")
    elif breakage == "nan":
        weights[0, 0, 3] = np.nan
    else:
        row = {"rank": [1, 0, 9], "layer": [1, 2, 4], "module": [9, 0, 4], "short row": [4, 0, 8]}[breakage]
        config[0, 0] = row
    if breakage in ("nan", "rank", "layer", "module", "short row"):
        save_trtllm(folder, weights[0], config[0])
    store = AdapterStore(roots / "store", "base", roots=(str(roots / "allowed"),), limits=LIMITS)
    err = refusal(store, "broken", str(folder))
    assert err.param == "lora_path" and words in err.message, err.message
    assert str(roots) not in err.message.replace(repr(str(folder)), "")


def test_two_loads_of_one_name_at_once_one_wins(roots):
    store = AdapterStore(roots / "store", "base", roots=(str(roots / "allowed"),), limits=LIMITS)

    async def both():
        return await asyncio.gather(store.load("twin", str(roots / "allowed/extra")), store.load("twin", "kept"),
                                    return_exceptions=True)
    first, second = asyncio.run(both())
    assert store.adapters["twin"] is first and first.path == roots / "allowed/extra"
    assert isinstance(second, OpenAIError) and second.status == 400 and "already" in second.message


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


def test_a_fifo_in_an_adapter_folder_is_refused_at_once(roots):
    import os
    import threading
    folder = roots / "allowed/fifo"
    write_adapter(folder)
    (folder / "model.lora_config.npy").unlink()
    os.mkfifo(folder / "model.lora_config.npy")                 # opened for reading, it would wait for a writer
    store = AdapterStore(roots / "store", "base", roots=(str(roots / "allowed"),), limits=LIMITS)
    answer: list = []
    thread = threading.Thread(target=lambda: answer.append(refusal(store, "fifo", str(folder))), daemon=True)
    thread.start()
    thread.join(timeout=10)
    assert answer and "model.lora_config.npy: is not a regular file" in answer[0].message


def test_a_file_swapped_for_a_link_is_not_followed(roots):
    from backend.lora.files import AdapterFileError, read_adapter_files
    folder = roots / "allowed/extra"
    (folder / "model.lora_weights.npy").rename(folder / "real.npy")
    (folder / "model.lora_weights.npy").symlink_to(folder / "real.npy")      # even one that stays inside
    with pytest.raises(AdapterFileError, match="model.lora_weights.npy: cannot be opened"):
        read_adapter_files(folder)


def test_weights_replaced_after_a_load_are_refused_not_served_under_the_old_id(roots):
    store = AdapterStore(roots / "store", "base", roots=(str(roots / "allowed"),), limits=LIMITS)
    adapter = loaded(store, "swapped", str(roots / "allowed/extra"))
    assert asyncio.run(adapter.inputs()).digest == adapter.digest
    write_adapter(roots / "allowed/extra", seed=99)                           # valid weights, other content
    with pytest.raises(AdapterInvalid, match="changed since it was loaded"):
        asyncio.run(adapter.inputs())


@pytest.mark.parametrize("a_shape, b_shape, words", [((4, 64), (500, 4), "do not fit"),
                                                      ((4, 64), (64, 6), "of one rank")])
def test_peft_tensors_of_the_wrong_shape_are_refused(roots, a_shape, b_shape, words):
    import torch
    from safetensors.torch import save_file
    folder = roots / "allowed/peft"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8}))
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    save_file({f"{prefix}.lora_A.weight": torch.ones(a_shape), f"{prefix}.lora_B.weight": torch.ones(b_shape)},
              folder / "adapter_model.safetensors")
    store = AdapterStore(roots / "store", "base", roots=(str(roots / "allowed"),), limits=LIMITS)
    err = refusal(store, "peft", str(folder))
    assert "adapter_model.safetensors" in err.message and words in err.message, err.message


def test_a_store_folder_with_a_fifo_is_left_out_and_said_so(store_dir):
    import os
    (store_dir / "beta" / "model.lora_config.npy").unlink()
    os.mkfifo(store_dir / "beta" / "model.lora_config.npy")
    store = AdapterStore(store_dir, "base")
    assert "beta" not in store.adapters and "alpha" in store.adapters
    assert any("'beta'" in line and "not a regular file" in line for line in store.prepare())


@pytest.mark.parametrize("path, words", [("extra\0x", "no NUL"), ("x" * 5000, "at most 4096"),
                                         ("/".join(["y" * 300] * 3), "not an adapter folder")])
def test_a_path_with_a_nul_or_past_the_limits_is_a_400_naming_lora_path(roots, path, words):
    store = AdapterStore(roots / "store", "base", roots=(str(roots / "allowed"),), limits=LIMITS)
    err = refusal(store, "x", path)
    assert err.param == "lora_path" and words in err.message


def test_a_name_that_would_shadow_a_prefixed_adapter_name_is_refused(roots):
    store = AdapterStore(roots / "store", "base", roots=(str(roots / "allowed"),), limits=LIMITS)
    err = refusal(store, "base_lora_kept", str(roots / "allowed/extra"))
    assert err.param == "lora_name" and "shadow" in err.message
    assert store.resolve("base_lora_kept") is store.adapters["kept"]
