"""The controller (the Ray driver): its states, the worlds it forms, the steps it drives, and every
Ray effect it causes (placement groups, actors, relays), behind one backend seam."""
