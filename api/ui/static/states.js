/* Kiln's browser UI: what a page says when the api does not answer as hoped.
 *
 * Every failure becomes one sentence a person can act on, and a Retry button: the api could not
 * be reached (not running, or the network), it refused the request (a 4xx: the server's own
 * message), or it failed (a 5xx: its log has the details). Loaded before app.js, which calls
 * `describeFailure` and `showProblem`.
 */
"use strict";

/** The api could not be reached at all (fetch threw, or a script error stood in for it). */
function isUnreachable(err) {
  return !err || err.status === 0 || err.status === undefined || err.code === "unreachable";
}

/** One sentence for a failed api call: unreachable, a refusal (4xx) or a server error (5xx). */
function describeFailure(err) {
  if (isUnreachable(err)) {
    return `The Kiln api at ${location.origin} cannot be reached: is it running? Start it with `
      + "kiln up (or kiln serve and kiln worker), then retry.";
  }
  const code = err.code && !/^http_\d+$/.test(err.code) ? `${err.code}, ` : "";
  const message = (err.message || "").trim();
  // ": the server's message." (a full stop added unless it ends a sentence itself)
  const said = message ? `: ${message}${/[.!?]$/.test(message) ? "" : "."}` : ".";
  if (err.status >= 500) {
    return `The Kiln api failed while answering (${code}HTTP ${err.status})${said}`
      + " Its log (kiln up: logs/serve.log under the storage root) has the details; retry once it is fixed.";
  }
  if (err.status === 404) {
    return `Not found (${code}HTTP 404)${said} It may have been deleted; retry or go back.`;
  }
  return `The Kiln api refused the request (${code}HTTP ${err.status})${said}`;
}

/** A problem as a paragraph with a Retry button (`retry` runs when pressed). */
function problemNodes(err, retry) {
  const nodes = [document.createTextNode(describeFailure(err))];
  if (err && err.hint) {
    const hint = document.createElement("span");
    hint.className = "hint";
    hint.textContent = ` ${err.hint}`;
    nodes.push(hint);
  }
  if (retry) {
    const button = document.createElement("button");
    button.type = "button";
    button.className = "small retry";
    button.textContent = "Retry";
    button.addEventListener("click", () => {
      button.disabled = true;
      retry();
    });
    nodes.push(document.createTextNode(" "), button);
  }
  return nodes;
}

/** Show a failure in the page's banner, with a Retry button; `null` hides the banner. */
function showProblem(err, retry) {
  const banner = document.getElementById("global-error");
  while (banner.firstChild) banner.removeChild(banner.firstChild);
  if (!err) {
    banner.hidden = true;
    delete banner.dataset.status;
    return;
  }
  banner.dataset.status = String(isUnreachable(err) ? 0 : err.status);
  banner.append(...problemNodes(err, retry));
  banner.hidden = false;
}

/** Put a value where the page showed a placeholder ("…") while it had none to show. */
function showUnknown(ids, text) {
  for (const id of ids) {
    const node = document.getElementById(id);
    if (node) node.textContent = text;
  }
}
