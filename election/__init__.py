"""Who serves: the flock owner election, one per scrape address."""

from election.lock import Outcome, OwnerElection, address_is_held, held_addresses_except, lock_file_name

__all__ = ["Outcome", "OwnerElection", "address_is_held", "held_addresses_except", "lock_file_name"]
