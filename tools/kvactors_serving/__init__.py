"""The deployment harness: vLLM's engine + LMCache's MP connector and server + the kvactors plugin.

Not installed: it lives in a checkout's ``tools/`` folder, and every process it starts gets that
folder first on ``PYTHONPATH`` (``procedure.engine_env``). Runs in the engine's environment
(``.venv-vllm``, ``scripts/setup-engine.sh``); ``kvactors validate-serving`` starts it as
``python -m kvactors_serving`` there, since kvactors itself never imports lmcache or vllm, and
the engine tests (``tests/engine``) import it. Modules: ``procedure`` (configurations, checks,
report), ``engine`` (one engine configuration per process), ``tap`` (the op wrapper in the
worker, and the vLLM plugin that installs it under ``vllm serve``), ``workload`` (prompts),
``model`` (the tiny model), ``server`` (LMCache's server), ``redis`` (a Redis L2),
``api_server`` (``vllm serve``), ``load`` (the load generator).
"""
