"""What the tests share, imported one way: ``from helpers.<module> import ...`` (pytest puts ``tests/`` on
``sys.path``; mypy's ``mypy_path`` is ``tests``). Fixtures stay in the ``conftest.py`` files, which import
what they need from here.

- :mod:`helpers.e2e`: sample tables, deadlines (``within``, ``eventually``), a server in a thread
  (``ServerThread``), a scripted raw TCP peer and raw frames, ``dissoc serve`` subprocesses and what a
  process holds;
- :mod:`helpers.transport`: connected pairs over TCP, TLS, UCX and in memory, and a raw-socket peer;
- :mod:`helpers.codec`: where the Arrow test data is, pyarrow as the oracle, strict comparisons;
  :mod:`helpers.ipcgen`: hand-built IPC messages, valid or malformed; :mod:`helpers.strategies`: hypothesis
  strategies for schemas and batches;
- :mod:`helpers.tls`: certificates made for a test;
- :mod:`helpers.ucx_wire`: speaking dissoc's UCX wire with ucxx alone;
- :mod:`helpers.hash_reference`: the numpy-only row hash that ``dissoc.hashing`` must equal;
- :mod:`helpers.reliability`: the reliability tests' datasets, a gracefully stopped server process, and its
  open fds and shared-memory segments.
"""
