"""Serving the target, as the steps and a pipeline's target service do: a server started and
stopped with a step, SGLang, the ``eyrie serve`` command, and the retries of a request to them.

- ``step_server.py``: a server as the step's child, healthy before the step goes on and stopped
  with it (:func:`~pipeline.steps.serving.step_server.running_server`); ``transformers serve``
  on a free loopback port.
- ``sglang.py``: SGLang's server command line, requests to it, and its GPU memory handed over to
  a step and taken back.
- ``serve_command.py``: ``eyrie serve``, the command a pipeline's target service runs (SGLang on
  the GPUs, ``transformers serve`` on a CPU), the server exec'd on the runner's port.
- ``http_retry.py``: which HTTP failures a later attempt may cure, and the backoff before it
  (``generate``, ``accept`` and SGLang's hand-over retry alike).

Light on purpose (nothing imported here): ``eyrie --help`` imports the package.
"""
