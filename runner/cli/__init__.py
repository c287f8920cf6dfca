"""The operator CLI, `runfleet` (SPEC §10). It sits at the top of the dependency order
(ADR-0001): every command parses its flags, calls `runner.operations` (the same operations the
console and the HTTP API call) and prints the answer, or the error with its exit code."""
