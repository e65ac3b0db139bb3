// The console's one script: each element with data-live is replaced by what its feed
// (server-sent events, /live/<page>) sends whenever that part of the page changes.
// The server escapes everything it renders; nothing here builds markup from data.
"use strict";
document.addEventListener("DOMContentLoaded", () => {
  const state = document.getElementById("feed-state");
  // "live" only while the console reaches the fabric: else what shows is frozen
  let fabricUp = true;
  const say = () => {
    if (!state) return;
    if (fabricUp) { state.textContent = "live"; state.className = "feed-state live"; }
    else {
      state.textContent = "fabric unreachable: figures as of " + new Date().toLocaleTimeString();
      state.className = "feed-state down";
    }
  };
  for (const element of document.querySelectorAll("[data-live]")) {
    const feed = new EventSource(element.dataset.live);
    feed.addEventListener("fabric", (event) => {
      const up = event.data === "up";
      if (up !== fabricUp) { fabricUp = up; say(); }
      document.body.dataset.fabric = event.data;
    });
    feed.addEventListener("update", (event) => {
      element.innerHTML = event.data;
      document.body.dataset.updates = String(Number(document.body.dataset.updates || 0) + 1);
      say();
    });
    feed.addEventListener("error", () => {
      // EventSource reconnects by itself; say so meanwhile
      if (state) { state.textContent = "reconnecting…"; state.className = "feed-state down"; }
    });
  }
});
