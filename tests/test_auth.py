"""API keys: where keys come from, owners, and the per-key prefix-cache salt, without a server; then the salt through
the real front in front of the int4 server, where each key finds only its own cached prefixes (tests/test_batch_api.py
checks the 401s and the owners of files and batches on a real front)."""

import pytest

from openai_api.auth import KEYS_ENV, KEYS_FILE_ENV, keys_from_environment, owner_of, tenant_salt
from scripts.launcher.openai_server import running_openai_api
from tests.helpers import lazy_module, variant_folder, wait_idle

openai = lazy_module("openai")


def test_keys_come_from_the_variable_and_from_a_mounted_file(tmp_path):
    path = tmp_path / "keys"
    path.write_text("k3\nk4,\n")
    assert keys_from_environment({KEYS_ENV: " k1, ,k2 ", KEYS_FILE_ENV: str(path)}) == ("k1", "k2", "k3", "k4")
    assert keys_from_environment({KEYS_FILE_ENV: str(tmp_path / "absent")}) == ()  # an optional Secret not created
    assert keys_from_environment({"OPENAI_API_KEY": "sk-mine"}) == (), "a user's OpenAI key never switches keys on"


def test_each_key_is_its_own_owner_and_salt_and_the_key_itself_appears_in_neither():
    a, b = owner_of("key-a-secret"), owner_of("key-b-secret")
    assert a != b and "secret" not in a
    assert tenant_salt(a, None) != tenant_salt(b, None)
    assert tenant_salt(a, "x") != tenant_salt(a, "y") != tenant_salt(a, None)
    assert len(tenant_salt(a, "s" * 256).encode()) <= 256
    assert tenant_salt("", "mine") == "mine" and tenant_salt("", None) == "", "without keys: the request's own salt"


# --- through the real front ---

# Two instructions that differ from their first word, so that no 16-token cache block of one is a block of the other.
INSTRUCTIONS = (
    "Harbour desk: answer in one short sentence, name the port if one is asked for, never invent tracking numbers, "
    "and say plainly when you do not know.",
    "Customs office: reply in a single plain sentence, give the form's number when one applies, never guess a duty "
    "rate, and ask for the invoice when it is missing.",
)


@pytest.mark.server
def test_a_cached_prefix_is_found_by_the_key_that_cached_it_and_by_no_other(variant_server, model_dir, tmp_path):
    """Through the front with API keys on, in front of the int4 server (prefix caching on), requests without a
    cache_salt: key A's cached instruction is not found by key B, nor B's by A, while each key finds its own (the
    server's prefix-cache hit counter says so)."""
    ports = variant_server("int4")
    keys = ("tenant-a-key", "tenant-b-key")
    with running_openai_api(f"127.0.0.1:{ports.grpc}", variant_folder(model_dir, "int4"), tmp_path / "api.log",
                            api_keys=keys) as url:
        clients = {key: openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120) for key in keys}
        model = clients[keys[0]].models.list().data[0].id

        def hits(key: str, instruction: str) -> float:
            """Prompt tokens that one request of this key found in the prefix cache."""
            before = wait_idle(ports).get("llm_prefix_cache_hits_total", 0)
            clients[key].chat.completions.create(
                model=model, messages=[{"role": "system", "content": instruction},
                                       {"role": "user", "content": "Where is Rotterdam?"}], max_tokens=4, temperature=0)
            return wait_idle(ports).get("llm_prefix_cache_hits_total", 0) - before

        a, b = keys
        first, second = INSTRUCTIONS
        assert hits(a, first) == 0, "the instruction is new to the cache"
        assert hits(b, first) == 0, "key B found key A's cached prefix"
        assert hits(b, second) == 0, "the instruction is new to the cache"
        assert hits(a, second) == 0, "key A found key B's cached prefix"
        assert hits(a, first) > 0, "key A does not find its own cached prefix"
        assert hits(b, second) > 0, "key B does not find its own cached prefix"
