"""The order-confirmation example: the source article's four-step workflow, its contract, a fake
tool service with drift injectors, and a scripted agent."""
