"""The generation step: prompts -> conversations through the target model (see driver.py)."""
