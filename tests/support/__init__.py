"""What the tests share: the code that starts workers and launchers, and the
models, workloads and checks that more than one test module uses.

Test modules import from here and never from one another, so a test can be
renamed or moved without breaking another file. Scripts that a test runs as
a file (``tests/*/scripts/``) stay beside their tests.
"""
