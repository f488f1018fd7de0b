from tests.deploy.helpers import helm

__all__ = ["helm"]
