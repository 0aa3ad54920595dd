"""Data-parallel replicas on Ray behind one OpenAI endpoint (app.py), routed by policy.py."""
