"""A model-based test of the claim / lease / disposition protocol (SPEC §13), and the broker
double it runs on, with the contract tests that hold the double to a real nats-server."""
