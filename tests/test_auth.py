"""API keys' plumbing without a server (tests/test_batch_api.py checks the 401s and owners on a real front): where
keys come from, owners, and the per-key prefix-cache salt."""

from openai_api.auth import KEYS_ENV, KEYS_FILE_ENV, keys_from_environment, owner_of, tenant_salt


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
