"""The serving validation: vLLM's engine + LMCache's MP connector and server + the kvactors plugin.

Runs in the engine's environment (``.venv-vllm``, ``scripts/setup-engine.sh``); ``kvactors
validate-serving`` starts it as ``python -m kvactors_serving`` there, since kvactors
itself never imports lmcache or vllm. Modules: ``procedure`` (configurations, checks, report),
``engine`` (one engine configuration per process), ``tap`` (the op wrapper in the worker),
``workload`` (prompts), ``model`` (the tiny model), ``server`` (LMCache's server).
"""
