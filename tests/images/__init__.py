"""Test images built without a registry. `fake_model`: a fake OpenAI-compatible model server."""
