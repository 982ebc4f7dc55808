// kafka-idem console: the page's only script (no framework, no other origin).
// Parts marked data-refresh-url are fetched again every data-refresh-seconds and
// replaced by the server's HTML (escaped there); once a part says data-final, the
// whole page is loaded once more (a job that ended shows its result and its form).
// A part sent to the login page instead (the session expired, or the console
// restarted) loads the whole page once more too: the login page, as a page, which
// comes back here after the login.
"use strict";
(function () {
  function refresh(el) {
    var url = el.getAttribute("data-refresh-url");
    var seconds = parseFloat(el.getAttribute("data-refresh-seconds") || "5");
    function tick() {
      fetch(url, { credentials: "same-origin", headers: { "Accept": "text/html" } })
        .then(function (r) {
          if (r.redirected) { window.location.reload(); return null; }
          return r.ok ? r.text() : Promise.reject(r.status);
        })
        .then(function (html) {
          if (html === null) { return; }
          el.innerHTML = html;
          if (el.querySelector("[data-final]")) { window.location.reload(); return; }
          window.setTimeout(tick, seconds * 1000);
        })
        .catch(function () { window.setTimeout(tick, seconds * 2000); });
    }
    window.setTimeout(tick, seconds * 1000);
  }
  function checkAll(box) {
    var name = box.getAttribute("data-check-all");
    box.addEventListener("change", function () {
      var form = box.form || document;
      form.querySelectorAll('input[type=checkbox][name="' + name + '"]').forEach(function (c) {
        c.checked = box.checked;
      });
    });
  }
  document.addEventListener("DOMContentLoaded", function () {
    document.querySelectorAll("[data-refresh-url]").forEach(refresh);
    document.querySelectorAll("[data-check-all]").forEach(checkAll);
  });
})();
