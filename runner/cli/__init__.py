"""The operator CLI, `runfleet` (SPEC §10). It sits at the top of the dependency order
(ADR-0001): every command is a thin shell over the store, engine, publisher and runner."""
