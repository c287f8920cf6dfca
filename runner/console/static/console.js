// Says when the console server stops answering a live page (its server-sent events fail), and
// clears the note once they flow again. Without it a page whose server was gone kept saying
// "live" with a frozen countdown, and the next click met the browser's own error page.
(function () {
  function note() { return document.getElementById("server-gone"); }
  document.body.addEventListener("htmx:sseError", function () {
    var n = note();
    if (n) { n.hidden = false; }
  });
  document.body.addEventListener("htmx:sseOpen", function () {
    var n = note();
    if (n) { n.hidden = true; }
  });
})();
