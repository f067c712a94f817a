"""Raises an unrelated exception from a nested function."""


def load_config(path):
    raise ValueError(f"bad config file: {path}")


def main():
    load_config("settings.yaml")


main()
